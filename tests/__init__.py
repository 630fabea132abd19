"""The test suite, in three groups (docs/architecture.md, "How the tests are grouped"):

- ``unit/``: no real model (random tiny models, pure logic);
- ``integration/``: the real smollm2-135m, servers, child processes and torchrun ranks;
- ``meta/``: the repository itself (import layers, docstrings, the README, committed figures,
  result names).

Shared fixtures are in ``conftest.py``; helpers that several test files use are modules of this
package (``kvp_helpers``, ``integration/serving``), imported as ``tests.<module>``.
"""

from pathlib import Path

#: The repository's root folder.
REPO = Path(__file__).resolve().parents[1]
