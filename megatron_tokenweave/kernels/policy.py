"""Host-side selection between the P2P kernel and the multimem (NVLink SHARP) kernel.

Pure Python (no CUDA calls), unit-tested on CPU. multimem is chosen only if ALL hold:
  * explicit opt-in: TOKENWEAVE_ALLOW_MULTIMEM=1;
  * the device reports multicast support;
  * no multicast kill-switch is set: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
    NVSHMEM_DISABLE_NVLS=1 (any truthy value of the last two, any falsy value of the first);
  * the caller supplied a multicast address of the buffer (this project never creates one).
The multimem kernel is compiled but untested on this project's machines (multicast is forbidden).
"""

from __future__ import annotations

from collections.abc import Mapping

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


def multimem_refusal(
    env: Mapping[str, str], device_supports_multicast: bool, multicast_base: int | None
) -> str | None:
    """Why multimem may not be used (None if it may)."""
    if not _truthy(env.get(OPT_IN_ENV)):
        return f"not opted in ({OPT_IN_ENV}=1 not set)"
    reason = multicast_disabled_reason(env)
    if reason is not None:
        return f"multicast disabled by {reason}"
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
