"""Host-side selection between the P2P kernel and the multimem (NVLink SHARP) kernel.

Pure Python (no CUDA calls), unit-tested on CPU. multimem is chosen only if ALL hold:
  * explicit opt-in: TOKENWEAVE_ALLOW_MULTIMEM=1;
  * the device reports multicast support;
  * no multicast kill-switch is set: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
    NVSHMEM_DISABLE_NVLS=1 (any truthy value of the last two, any falsy value of the first);
  * the caller supplied a multicast address of the buffer (this project never creates one).
The multimem kernel is compiled but untested on this project's machines (multicast is forbidden).

The multimem *backend* (TokenWeaveConfig.backend="multimem": the communicator's buffer from torch
symmetric memory, whose rendezvous maps multicast where the machine allows it) is refused, naming
the first failing condition, by `multimem_backend_refusal`; every rank evaluates it and the ranks
agree (kernels.multicast.agreed_refusal).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from megatron_tokenweave.ops.validate import TokenWeaveInputError

OPT_IN_ENV = "TOKENWEAVE_ALLOW_MULTIMEM"
P2P = "p2p"
MULTIMEM = "multimem"
BACKENDS = ("auto", P2P, MULTIMEM)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _truthy(v: str | None) -> bool:
    return v is not None and v.strip().lower() in _TRUE


def _falsy(v: str | None) -> bool:
    return v is not None and v.strip().lower() in _FALSE


def multicast_disabled_reason(env: Mapping[str, str]) -> str | None:
    """Name of the kill-switch that forbids multicast, or None."""
    if _falsy(env.get("NCCL_NVLS_ENABLE")):
        return "NCCL_NVLS_ENABLE=0"
    if _truthy(env.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")):
        return "TORCH_SYMM_MEM_DISABLE_MULTICAST=1"
    if _truthy(env.get("NVSHMEM_DISABLE_NVLS")):
        return "NVSHMEM_DISABLE_NVLS=1"
    return None


class Refusal(NamedTuple):
    """Why the multimem backend may not run: `code` (one of the REFUSED_* constants, ordered as
    the conditions are checked) and a message naming the failing condition."""

    code: int
    reason: str


REFUSED_NOT_REQUESTED = 1
REFUSED_NOT_OPTED_IN = 2
REFUSED_KILL_SWITCH = 3
REFUSED_NO_SYMM_MEM = 4
REFUSED_NO_MULTICAST = 5
REFUSED_MULTI_NODE = 6
REFUSED_OLD_GPU = 7
# The oldest GPU with multimem.* instructions (Hopper).
MIN_MULTIMEM_CAPABILITY = (9, 0)


def _env_refusal(env: Mapping[str, str]) -> Refusal | None:
    """The environment's part: the explicit opt-in, then the kill switches."""
    if not _truthy(env.get(OPT_IN_ENV)):
        return Refusal(REFUSED_NOT_OPTED_IN, f"not opted in ({OPT_IN_ENV}=1 not set)")
    reason = multicast_disabled_reason(env)
    if reason is not None:
        return Refusal(REFUSED_KILL_SWITCH, f"multicast disabled by {reason}")
    return None


def multimem_refusal(
    env: Mapping[str, str], device_supports_multicast: bool, multicast_base: int | None
) -> str | None:
    """Why multimem may not be used (None if it may)."""
    refusal = _env_refusal(env)
    if refusal is not None:
        return refusal.reason
    if not device_supports_multicast:
        return "device does not report multicast support"
    if not multicast_base:
        return "no multicast address given for the buffer"
    return None


def select_backend(
    requested: str,
    env: Mapping[str, str],
    device_supports_multicast: bool,
    multicast_base: int | None,
) -> str:
    """Return "p2p" or "multimem". "auto" never picks multimem unless everything allows it;
    an explicit "multimem" that is not allowed raises TokenWeaveInputError."""
    if requested not in BACKENDS:
        raise TokenWeaveInputError(f"backend must be one of {BACKENDS}, got {requested!r}")
    if requested == P2P:
        return P2P
    refusal = multimem_refusal(env, device_supports_multicast, multicast_base)
    if requested == MULTIMEM and refusal is not None:
        raise TokenWeaveInputError(f"multimem backend refused: {refusal}")
    return MULTIMEM if refusal is None else P2P


@dataclass(frozen=True)
class MulticastFacts:
    """What the multimem backend needs to know of one rank (kernels.multicast.probe gathers it).

    device: the rank's device, e.g. "cuda:0" (for messages).
    symm_mem_error: why torch symmetric memory cannot serve this device (None: it can).
    multicast: torch reports multicast support for the device.
    nodes: distinct hosts in the TP group.
    capability: the GPU's compute capability (major, minor).
    """

    device: str
    symm_mem_error: str | None
    multicast: bool
    nodes: int
    capability: tuple[int, int]


def multimem_backend_refusal(
    requested: str, env: Mapping[str, str], probe: Callable[[], MulticastFacts]
) -> Refusal | None:
    """Why the multimem backend may not run on this rank (None if it may), naming the first
    failing condition: not requested (backend != "multimem"), not opted in
    (TOKENWEAVE_ALLOW_MULTIMEM=1), a multicast kill switch set, torch symmetric memory
    unavailable, no multicast support reported by torch for the device, the TP group on more
    than one node, a GPU before sm_90. `probe` is called only once the first three pass, so a
    refusal by the environment queries no device."""
    if requested != MULTIMEM:
        return Refusal(REFUSED_NOT_REQUESTED,
                       f'backend "{MULTIMEM}" not requested (backend is {requested!r})')
    refusal = _env_refusal(env)
    if refusal is not None:
        return refusal
    facts = probe()
    if facts.symm_mem_error is not None:
        return Refusal(REFUSED_NO_SYMM_MEM,
                       f"torch symmetric memory is unavailable on {facts.device}: "
                       f"{facts.symm_mem_error}")
    if not facts.multicast:
        return Refusal(REFUSED_NO_MULTICAST,
                       f"torch reports no multicast support for {facts.device} (needs NVSwitch "
                       "with NVLink SHARP and a driver that allows multicast)")
    if facts.nodes != 1:
        return Refusal(REFUSED_MULTI_NODE,
                       f"the TP group spans {facts.nodes} nodes (multicast needs one node)")
    if tuple(facts.capability) < MIN_MULTIMEM_CAPABILITY:
        major, minor = facts.capability
        return Refusal(REFUSED_OLD_GPU,
                       f"{facts.device} is sm_{major}{minor}; multimem needs sm_90 or newer")
    return None
