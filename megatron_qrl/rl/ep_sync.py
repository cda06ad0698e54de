"""qrl-train's sharded weight sync: trainer EP > 1 ranks send their own experts to the fleet.

The gathering sync (:func:`megatron_qrl.rl.sync.sync_weights` on
:meth:`~megatron_qrl.rl.trainer.PolicyTrainer.hf_tensors`) all-gathers every expert onto rank
0, which sends the whole model. Here (where :func:`sharded_sync_applies`, THE rule) every
rank streams :func:`~megatron_qrl.rl.ep_send.sharded_hf_stream` (no gather over EP): rank 0
its non-expert tensors and experts through the fleet's group 0
(:meth:`~megatron_qrl.rollout.transports.fleet.FleetBroadcast.sharded`), EP sender ``s`` its
experts through group ``s``, which it hosts. Per sync (and per re-sync of a restarted
engine, announced to the other ranks as before: :mod:`megatron_qrl.rl.rank_resync`):

1. rank 0 broadcasts the sync's header (a ``SYNC`` message of
   :mod:`~megatron_qrl.rl.rank_resync`: version, AQN step, and the groups' base name when
   the engines changed: the senders then gather their rendezvous addresses to rank 0 and
   host their groups while the engine actors join);
2. every rank packs its stream (AQN, then ``spec.pack_state_dict``) and records its
   manifest; the senders send their segments (:func:`~megatron_qrl.rollout.transports.sharded.
   send_segments`), the other ranks drain theirs (their tensor-parallel gathers);
3. the manifests are gathered to rank 0 and combined (a name sent twice is refused), and
   every engine is verified against them, with its weight version.

AQN perturbs norm gains only (non-expert tensors, rank 0's stream) in the gathering path's
order, so the engines end with the gathering path's exact state. Not applied (the gathering
path instead): one trainer rank or EP 1, LoRA runs, the object-store transport, SGLang
engines (their TP ranks do not join the senders' groups yet: the actor would have to pass
every sender's segments on), and a single engine actor without ``--qrl-rollout-num-engines``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from megatron_qrl.quant.aqn import AQNConfig, apply_aqn
from megatron_qrl.quant.spec import QuantSpec
from megatron_qrl.rl.ep_send import ep_sender, sharded_hf_stream
from megatron_qrl.rl.rank_resync import RESYNC, SYNC, post, receive
from megatron_qrl.rl.sync import SyncResult
from megatron_qrl.rollout.base import WeightManifest, WeightSyncError
from megatron_qrl.rollout.broadcast import free_port, init_group
from megatron_qrl.rollout.transports.fleet import release_group
from megatron_qrl.rollout.transports.sharded import send_segments
from megatron_qrl.rollout.weight_groups import weight_group_plan
from megatron_qrl.utils.ranks import own_address

__all__ = ["ShardedSync", "sharded_sync_applies"]


def sharded_sync_applies(engine: Any, groups: Any, lora: bool) -> bool:
    """THE rule (rank 0, broadcast to all): the sharded sync where the trainer has EP > 1
    and the engine is a fleet whose broadcast groups take it (module docstring)."""
    ep = getattr(groups, "ep", None)
    if getattr(groups, "stage", None) is not None:  # pipeline stages: rl.pipeline's stream
        return False
    if lora or ep is None or not dist.is_initialized() or dist.get_world_size(ep) < 2:
        return False
    return bool(getattr(getattr(engine, "broadcast", None), "shardable", False))


def _gather(obj: Any) -> list[Any] | None:
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


@dataclass
class ShardedSync:
    """Every rank's part of the sharded sync (module docstring)."""

    trainer: Any
    spec: QuantSpec
    aqn: AQNConfig | None
    seed: int
    group: Any = None
    """A sender > 0: the weight group it hosts (formed anew when the engines change)."""
    sent_bytes: list[int] = field(default_factory=list)
    """Per sync: the packed bytes this rank sent (or, rank 0, put in its own stream)."""

    def _packed(self, version: int, aqn_step: int, total_steps: int, manifest: WeightManifest):
        sigma = self.aqn.sigma(aqn_step, total_steps) if self.aqn is not None else 0.0
        groups = self.trainer.policy.groups
        stream = sharded_hf_stream(self.trainer.module, self.trainer.policy.arch, groups)
        if sigma > 0.0:
            stream = apply_aqn(stream, sigma, AQNConfig.generator(self.seed, version))
        self.sent_bytes.append(0)

        def counted(pairs):
            for name, t in pairs:
                self.sent_bytes[-1] += t.numel() * t.element_size()
                yield name, t

        return counted(manifest.record(self.spec.pack_state_dict(stream))), sigma

    def send(self, engine: Any, version: int, aqn_step: int = 0,
             total_steps: int = 1) -> SyncResult:
        """Rank 0: sync ``engine`` (an :class:`~megatron_qrl.rollout.fleet.EngineFleet`)."""
        manifest = WeightManifest()
        stream, sigma = self._packed(version, aqn_step, total_steps, manifest)
        peers = _Peers(ep_sender(self.trainer.policy.groups).senders,
                       (version, aqn_step, total_steps), engine.broadcast)
        with engine.broadcast.sharded(peers):
            engine.update_weights(stream, version)
        twice = set(manifest.checksums) & set(peers.others)
        if twice:
            raise RuntimeError(f"sharded weight sync: {sorted(twice)[:3]} sent by two ranks")
        manifest.checksums.update(peers.others)
        try:
            engine.verify(manifest)
        except WeightSyncError as exc:
            raise WeightSyncError(f"{exc}; the other senders reported: {peers.errors}") from exc
        if engine.weight_version() != version:
            raise RuntimeError(f"engine reports weight version {engine.weight_version()} after "
                               f"an update to version {version}")
        return SyncResult(version, len(manifest.checksums), sigma)

    def serve(self, *_: Any) -> None:
        """A rank > 0: its part of the sync rank 0 runs now (module docstring). A ``RESYNC``
        while it waits for the header: rank 0 gave that sync up before its header (an engine
        found dead before the groups formed: nothing streamed on any rank) and re-syncs a
        restarted engine instead, whose header follows."""
        kind = RESYNC
        while kind == RESYNC:
            kind, header = receive(SYNC, RESYNC)
        (version, aqn_step, total_steps), base, world_size, how = header
        sender = ep_sender(self.trainer.policy.groups)
        index = sender.index or 0  # 0: sends nothing (rank 0 is never here)
        error = None
        if base is not None:
            self.close()
            host, port = own_address(), free_port()
            _gather((index, host, port) if index else None)
            if index:
                plan = weight_group_plan([1] * (world_size - 1), senders=sender.senders)
                try:  # an engine that died joining: rank 0 restarts it, this rank reports
                    self.group = init_group(host, port, world_size, 0,
                                            plan.group_name(base, index), how["backend"],
                                            how["timeout_s"])
                except Exception as exc:  # noqa: BLE001 - reported to rank 0 below
                    error = f"rank {dist.get_rank()}: joining: {exc}"
        manifest = WeightManifest()
        stream, _ = self._packed(version, aqn_step, total_steps, manifest)
        if index and self.group is not None:
            device = "cuda" if how["backend"] == "nccl" else "cpu"
            try:
                send_segments(stream, self.group, device, how["bucket_bytes"])
            except Exception as exc:  # noqa: BLE001 - reported to rank 0, which restarts
                error = f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"
            if error is not None:  # after the except block (transports.fleet.release_group)
                self.close()
        for _ in stream:  # a non-sender, or a broken send: this rank's gathers still run
            pass
        _gather((manifest.checksums if index else {}, error))

    def close(self) -> None:
        """Destroy this sender's group (never raises)."""
        group, self.group = self.group, None
        if group is not None:
            release_group(group)


@dataclass
class _Peers:
    """Rank 0's :class:`~megatron_qrl.rollout.transports.fleet.ShardedPeers`: the other ranks."""

    senders: int
    header: tuple[int, int, int]
    broadcast: Any
    others: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def start(self, rejoin: str | None, world_size: int) -> list[tuple[str, int]]:
        how = {"backend": self.broadcast.backend, "timeout_s": self.broadcast.timeout_s,
               "bucket_bytes": self.broadcast.bucket_bytes}
        post(SYNC, (self.header, rejoin, world_size, how))
        if rejoin is None:
            return []
        hosts = {a[0]: (a[1], a[2]) for a in _gather(None)[1:] if a is not None}
        if sorted(hosts) != list(range(1, self.senders)):
            raise RuntimeError(f"sharded weight sync: senders {sorted(hosts)} reported, "
                               f"expected 1..{self.senders - 1}")
        return [hosts[s] for s in range(1, self.senders)]

    def finish(self, failed: bool) -> None:
        for checksums, error in _gather(({}, None))[1:]:
            self.others.update(checksums)
            if error:
                self.errors.append(error)
