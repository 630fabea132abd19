"""The KV-Runahead chain's point-to-point communication, behind one object that checks its use.

In the spirit of ring-flash-attention's ``RingComm``: operations are *queued*
(:meth:`ChainComm.send_recv`), *posted* together (:meth:`ChainComm.commit`, non-blocking
``isend``/``irecv`` of torch.distributed) and *waited* for (:meth:`ChainComm.wait`). Rank ``i``
only ever receives from ``i - 1`` and sends to ``i + 1``. Every message is one layer's keys or
values of the accumulated prefix; its shape ``(1, H_kv, s, d)`` is known in advance from the
frozen :class:`~fastprefill.methods.runahead.plan.PartitionPlan` (rank ``i`` receives
``s_i = c_0 + ... + c_{i-1}`` rows, sends ``s_{i+1}``), so there is no shape handshake; a tensor
of another shape is refused before it is sent.

Misuse raises :class:`ChainCommError`: a receive on rank 0, a send from the last rank, a second
queue for the same (layer, direction), a commit with nothing queued (double commit), a wait for
something never committed, a wrong shape or dtype. Waits are bounded by ``timeout_s``: a dead
or hung neighbour turns into a :class:`ChainCommError` naming the rank and layer, never a hang.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastprefill.errors import FastprefillError
from fastprefill.methods.runahead.plan import PartitionPlan

__all__ = ["ChainComm", "ChainCommError"]


class ChainCommError(FastprefillError, RuntimeError):
    """Misuse of :class:`ChainComm`, or a neighbour rank that died or timed out."""


@dataclass
class _Pending:
    keys: torch.Tensor
    values: torch.Tensor
    works: list | None = None  # set on commit


class ChainComm:
    """Point-to-point KV messages of one prefill along the chain ``0 -> 1 -> ... -> P-1``.

    Args:
        plan: the frozen partition (gives every message's row count).
        rank: this process's rank in ``group``.
        kv_heads: ``H_kv``; head_dim: ``d``; dtype/device: of the KV tensors.
        group: the process group (``None``: the default group).
        timeout_s: bound on every wait.

    Tags: the keys of layer ``l`` travel with tag ``2 l``, the values with ``2 l + 1``.
    """

    def __init__(
        self,
        plan: PartitionPlan,
        rank: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        if not 0 <= rank < plan.procs:
            raise ChainCommError(f"rank {rank} outside the plan's {plan.procs} ranks")
        self.plan, self.rank = plan, rank
        self.kv_heads, self.head_dim, self.dtype, self.device = kv_heads, head_dim, dtype, device
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._queued_recv: dict[int, _Pending] = {}
        self._queued_send: dict[int, _Pending] = {}
        self._recvs: dict[int, _Pending] = {}
        self._sends: dict[int, _Pending] = {}
        self._seen_recv: set[int] = set()
        self._seen_send: set[int] = set()
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.plan.procs - 1

    def _shape(self, rows: int) -> tuple[int, int, int, int]:
        return (1, self.kv_heads, rows, self.head_dim)

    # --- queue ----------------------------------------------------------------------------------
    def send_recv(
        self, layer: int, send: tuple[torch.Tensor, torch.Tensor] | None = None, recv: bool = False
    ) -> None:
        """Queue, for ``layer``, a send of the accumulated ``(keys, values)`` to the next rank
        and/or a receive of the prefix from the previous one. Nothing moves until :meth:`commit`.

        Args:
            send: keys and values ``(1, H_kv, s_{i+1}, d)`` of chunks ``0..i`` at this layer.
            recv: queue a receive of ``(1, H_kv, s_i, d)`` keys and values.
        """
        if send is None and not recv:
            raise ChainCommError("send_recv: nothing to queue (give send=... and/or recv=True)")
        if recv:
            if self.is_first:
                raise ChainCommError("rank 0 holds the first chunk and has no prefix to receive")
            if layer in self._seen_recv:
                raise ChainCommError(f"rank {self.rank}: a receive for layer {layer} was already queued")
            rows = self.plan.start(self.rank)
            shape = self._shape(rows)
            self._queued_recv[layer] = _Pending(
                torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=self.dtype, device=self.device),
            )
            self._seen_recv.add(layer)
        if send is not None:
            if self.is_last:
                raise ChainCommError("the last rank has nobody to send to; it keeps the full KV cache")
            if layer in self._seen_send:
                raise ChainCommError(f"rank {self.rank}: a send for layer {layer} was already queued")
            want = self._shape(self.plan.start(self.rank + 1))
            keys, values = send
            for name, t in (("keys", keys), ("values", values)):
                if tuple(t.shape) != want or t.dtype != self.dtype:
                    raise ChainCommError(
                        f"rank {self.rank} layer {layer}: {name} {tuple(t.shape)} {t.dtype}, but the plan "
                        f"{list(self.plan.chunks)} fixes {want} {self.dtype}"
                    )
            self._queued_send[layer] = _Pending(keys.contiguous(), values.contiguous())
            self._seen_send.add(layer)

    def commit(self) -> None:
        """Post every queued operation (non-blocking). Raises if nothing is queued."""
        if not self._queued_recv and not self._queued_send:
            raise ChainCommError("commit with nothing queued (double commit?)")
        peer_prev, peer_next = self.rank - 1, self.rank + 1
        for layer, p in self._queued_recv.items():
            p.works = [
                dist.irecv(p.keys, src=peer_prev, group=self.group, tag=2 * layer),
                dist.irecv(p.values, src=peer_prev, group=self.group, tag=2 * layer + 1),
            ]
            self._recvs[layer] = p
        for layer, p in self._queued_send.items():
            p.works = [
                dist.isend(p.keys, dst=peer_next, group=self.group, tag=2 * layer),
                dist.isend(p.values, dst=peer_next, group=self.group, tag=2 * layer + 1),
            ]
            self._sends[layer] = p
            self.bytes_sent += 2 * p.keys.numel() * p.keys.element_size()
        self._queued_recv.clear()
        self._queued_send.clear()

    # --- wait -----------------------------------------------------------------------------------
    def _wait_works(self, works: list, what: str) -> None:
        for w in works:
            try:
                ok = w.wait(self.timeout)
            except RuntimeError as exc:  # gloo: peer closed the connection or the wait timed out
                raise ChainCommError(
                    f"rank {self.rank}: {what} failed ({str(exc).splitlines()[0][:200]}); a neighbouring "
                    "rank died or hung"
                ) from None
            if ok is False:
                raise ChainCommError(f"rank {self.rank}: {what} timed out after {self.timeout.total_seconds():.0f} s")

    def wait(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block until the prefix ``(keys, values)`` of ``layer``, each ``(1, H_kv, s_i, d)``, is here."""
        p = self._recvs.pop(layer, None)
        if p is None:
            state = "queued but not committed" if layer in self._queued_recv else "never queued"
            raise ChainCommError(f"rank {self.rank}: wait for layer {layer}: its receive was {state}")
        self._wait_works(p.works or [], f"receiving layer {layer} from rank {self.rank - 1}")
        self.bytes_received += 2 * p.keys.numel() * p.keys.element_size()
        return p.keys, p.values

    def flush(self) -> None:
        """Wait for every posted send (call at the end of a prefill). Raises if a receive is left
        un-waited or something is still queued."""
        if self._queued_recv or self._queued_send:
            raise ChainCommError(f"rank {self.rank}: operations queued but never committed")
        if self._recvs:
            raise ChainCommError(f"rank {self.rank}: receives for layers {sorted(self._recvs)} never waited")
        for layer in sorted(self._sends):
            self._wait_works(self._sends.pop(layer).works or [], f"sending layer {layer} to rank {self.rank + 1}")
