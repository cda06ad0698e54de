"""The Ray side's weight transports, one file each (:class:`~megatron_qrl.sync.transport.
WeightTransport`, registered on import):

- side ``ray``, one engine actor (:class:`~megatron_qrl.rollout.ray_actor.RayEngine`, chosen
  by ``--qrl-ray-weight-transport``): :mod:`.objectstore`, :mod:`.broadcast`, :mod:`.ipc`;
- side ``fleet``, every engine of a fleet at once: :mod:`.fleet` (one group, each bucket
  broadcast once) and :mod:`.sharded` (trainer EP > 1: each sender's segments).

What a transport needs of the actor proxy is its :class:`~.link.ActorLink`."""

from . import broadcast, fleet, ipc, objectstore, sharded  # noqa: F401  (registration)
from .link import ActorLink

__all__ = ["ActorLink"]
