"""The woven layers: Megatron's layer classes with the woven schedule of DESIGN.md.

One mixin, `WovenLayer`, on each layer class a Megatron stack builds: TransformerLayer (GPTModel
layers, hybrid '*' and 'G'), MLPLayer (hybrid '-'), MoETransformerLayer (hybrid 'E') and
MambaLayer (hybrid 'M'). A layer is a sequence of mixer stages (megatron_tokenweave.stages);
per forward the tokens are split in halves A and B (rows of every chunk; a chunk is one rank's
sequence shard, or all rows without sequence parallelism) and one half's fused all-reduce + add
+ RMSNorm runs beside the other half's GEMMs: the steps are megatron_tokenweave.woven's. Below
the split threshold there is one half and the fused op runs on the main stream. Where the fused
path does not apply, the stock layer's forward runs (logged once).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

from megatron_tokenweave import fp8_gemm, moe
from megatron_tokenweave.communicator import find_communicator, get_communicator
from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.linears import WovenLinearMixin
from megatron_tokenweave.log import log_once
from megatron_tokenweave.norm import norm_weight_eps, norm_weight_eps_in
from megatron_tokenweave.ops.validate import KERNEL_DTYPES, SUPPORTED_DTYPES, VECTOR_ELEMS
from megatron_tokenweave.policy import TableKey, get_policy
from megatron_tokenweave.precision import gemm_precision, unwoven_reason
from megatron_tokenweave.schedule import Handoff, WeaveChain, plan_halves
from megatron_tokenweave.stages import MixerStage, layer_stages
from megatron_tokenweave.woven import WovenForward

CHAIN_ATTR = "_tokenweave_last_built_layer"


class WovenLayer:
    """A Megatron layer whose row-parallel all-reduces and the norms after them are fused and
    overlapped with the other half of the tokens. Same parameters and checkpoint keys as the
    stock layer built from the same spec. Mixed into a Megatron layer class (first base)."""

    # What the stock class's forward returns: TransformerLayer (output, context), MambaLayer
    # the output alone.
    _returns_context = True
    _stock: type  # the Megatron class a subclass weaves (its last base), whose forward falls back

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._stock = cls.__bases__[-1]

    def __init__(
        self, *args: Any, tokenweave_config: TokenWeaveConfig | None = None, **kwargs: Any
    ):
        super().__init__(*args, **kwargs)
        self.tokenweave_config = TokenWeaveConfig.from_env(tokenweave_config)
        self._chain = self._join_chain()
        self._register_load_state_dict_pre_hook(self._accept_stock_norm_keys)
        # Fused-op arguments are checked in Python until one woven forward passed (later calls:
        # the op's own C++ checks of shapes, dtypes, devices and alignment).
        self._validated = False

    def _stages(self) -> tuple[MixerStage, ...]:
        """The layer's mixer stages, found once (kept out of the module's registry: they name
        submodules the layer already owns)."""
        if "_tokenweave_stages" not in self.__dict__:
            self.__dict__["_tokenweave_stages"] = layer_stages(self)
        return self.__dict__["_tokenweave_stages"]

    def first_norm(self) -> torch.nn.Module:
        """The norm of the layer's first stage: what the predecessor's last fused op applies."""
        return getattr(self, self._stages()[0].norm_name)

    def _accept_stock_norm_keys(self, state_dict: dict, prefix: str, *_: Any) -> None:
        """Load TE-spec state dicts, whose norm weights live in the fused TE linears. Our
        separate TE norms carry an `_extra_state` (quantization metadata) that such a state
        dict cannot have: they keep their own."""
        for ours, theirs in self.submodules_config.sharded_state_dict_keys_map.items():
            for suffix in ("weight", "bias"):
                stock_key, our_key = prefix + theirs + suffix, prefix + ours + suffix
                if stock_key in state_dict and our_key not in state_dict:
                    state_dict[our_key] = state_dict.pop(stock_key)
        for stage in self._stages():
            norm = getattr(self, stage.norm_name)
            extra_key = f"{prefix}{stage.norm_name}._extra_state"
            has_extra = type(norm).get_extra_state is not torch.nn.Module.get_extra_state
            if has_extra and extra_key not in state_dict and \
                    f"{prefix}{stage.norm_name}.weight" in state_dict:
                state_dict[extra_key] = norm.get_extra_state()

    # ----------------------------------------------------------------- construction
    def _join_chain(self) -> WeaveChain:
        """Share the chain of the layer built just before this one, if it is our predecessor
        (the next layer number, the same TP group). A stack that must not hand work past its
        end (a pipeline stage's) forgets its last layer when it is built (`seal_chain`)."""
        ref = getattr(self.config, CHAIN_ATTR, None)
        prev = ref() if ref is not None else None
        object.__setattr__(self.config, CHAIN_ATTR, weakref.ref(self))
        if (
            isinstance(prev, WovenLayer)
            and prev.layer_number == self.layer_number - 1
            and prev.tp_group is self.tp_group
        ):
            prev._chain.link(prev, self)
            return prev._chain
        return WeaveChain()

    @functools.cached_property
    def _tp(self) -> tuple[int, int]:
        """(world size, rank) of the layer's tensor-parallel group, which never changes: asked
        once, not on every forward (torch.distributed's lookups are host time per layer)."""
        if self.tp_group is None:
            return 1, 0
        return dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)

    @functools.cached_property
    def _gemm_precision(self) -> str:
        """The GEMMs' precision (a split table's key), fixed once the model is built: read once,
        not per forward."""
        return gemm_precision(self.config)

    # ----------------------------------------------------------------- policy
    def _check_structure(self) -> str | None:
        """Why the layer's configuration or module types rule the fused path out (None when
        they do not)."""
        cfg = self.config
        if cfg.normalization != "RMSNorm":
            return f"normalization is {cfg.normalization}, the fused op is RMSNorm"
        stages = self._stages()
        if not stages:
            return "the layer has no mixer"
        for stage in stages:
            if norm_weight_eps(getattr(self, stage.norm_name)) is None:
                return f"the layer's {stage.norm_name} is not a plain RMSNorm module"
        if cfg.hidden_size % VECTOR_ELEMS != 0:
            return f"hidden size {cfg.hidden_size} is not a multiple of {VECTOR_ELEMS}"
        if cfg.fp32_residual_connection:
            return "fp32_residual_connection is set"
        if cfg.context_parallel_size > 1:
            return "context parallelism is not supported"
        if not isinstance(getattr(self, "cross_attention", IdentityOp()), IdentityOp):
            return "cross-attention layers are not supported"
        for stage in stages:
            if stage.is_moe:
                continue
            if stage.column is None or stage.row is None:
                return (f"{type(stage.mixer).__name__} is not a mixer TokenWeave weaves (its "
                        "linears are not linear_qkv/linear_proj, in_proj/out_proj or "
                        "linear_fc1/linear_fc2)")
            if not (isinstance(stage.column, WovenLinearMixin)
                    and isinstance(stage.row, WovenLinearMixin)):
                return f"the {stage.kind} stage's linears are not TokenWeave linears"
        linears = [m for s in stages if not s.is_moe for m in (s.column, s.row)]
        precision = unwoven_reason(cfg, linears)
        if precision is not None:
            return precision
        return None

    def _structure_reason(self) -> str | None:
        """_check_structure's answer, computed at the first forward and kept: the model's
        configuration and module types do not change once it is built, and asking every forward
        is host time per layer. (Kept by hand, not as a cached_property: an AttributeError
        inside a property of an nn.Module surfaces as a missing attribute.)"""
        if "_structure_checked" not in self.__dict__:
            self.__dict__["_structure_checked"] = (self._check_structure(),)
        return self.__dict__["_structure_checked"][0]

    def _unsupported_reason(self, hidden_states: torch.Tensor) -> str | None:
        """Why the fused path cannot run this call (None when it can)."""
        if self._tp[0] < 2:
            return "tensor-parallel size is 1"
        if torch.is_grad_enabled():
            return "gradients are enabled (TokenWeave is an inference schedule)"
        structure = self._structure_reason()
        if structure is not None:
            return structure
        for stage in self._stages():  # per call: Megatron's engines switch the experts'
            if stage.is_moe:  # padding between prefill and decode steps
                reason = moe.unsupported_reason(stage.mixer)
                if reason is not None:
                    return reason
        if hidden_states.dtype not in SUPPORTED_DTYPES:
            return f"dtype {hidden_states.dtype} is not supported"
        if hidden_states.dtype not in KERNEL_DTYPES and hidden_states.is_cuda:
            return f"the CUDA kernel takes bf16/fp16, not {hidden_states.dtype}"
        if hidden_states.dim() != 3 or not hidden_states.is_contiguous():
            return "hidden_states is not a contiguous [s, b, h] tensor"
        if self._fp8_now():
            reason = fp8_gemm.autocast_reason()
            if reason is not None:
                return reason
            if hidden_states.shape[0] * hidden_states.shape[1] % fp8_gemm.FP8_ROWS:
                return (f"FP8 GEMMs take multiples of {fp8_gemm.FP8_ROWS} rows per chunk (the "
                        "stock path pads them, as Megatron's FP8 inference padding does)")
        return None

    @functools.cached_property
    def _te_linears(self) -> bool:
        """Whether every woven linear of the layer is a TE one (whose GEMMs follow TE's FP8
        autocast, as in the stock forward)."""
        return all(fp8_gemm.is_te(m) for s in self._stages() if not s.is_moe
                   for m in (s.column, s.row))

    def _fp8_now(self) -> bool:
        """Whether this call's linears run FP8 GEMMs: TE linears inside an enabled FP8 autocast,
        which is what decides it for the stock TE linears too (Megatron enters it per layer from
        config.fp8, and leaves a model's first / last layers in bf16 where asked)."""
        return self._te_linears and fp8_gemm.active()

    # ----------------------------------------------------------------- forward
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        handoff = self._chain.claim(hidden_states)
        reason = self._unsupported_reason(hidden_states)
        if reason is not None:
            stock = self._stock.__name__
            log_once(f"fallback:{stock}:{reason}", f"TokenWeave: stock {stock} path ({reason})")
            if handoff is not None:
                handoff.wait()  # the stock path reads the residual on the current stream
            out = super().forward(hidden_states, *args, **kwargs)
            if self._chain.successor(self) is None:  # the block's end: copy the error words
                cfg = self.tokenweave_config
                comm = find_communicator(self.tp_group, hidden_states.shape[-1],
                                         hidden_states.dtype, hidden_states.device, cfg.backend)
                if comm is not None:
                    comm.record_errors()
            return out
        try:
            if args:
                raise TypeError(f"{type(self).__name__} takes the layer's arguments by keyword")
            out = self._woven_forward(hidden_states, handoff, kwargs)
        except BaseException:
            if handoff is not None:
                handoff.wait()  # the predecessor's rows are complete even when this layer fails
            raise
        return (out, kwargs.get("context")) if self._returns_context else out

    def _woven_forward(
        self, x: torch.Tensor, handoff: Handoff | None, layer_kwargs: dict[str, Any]
    ) -> torch.Tensor:
        cfg, group = self.tokenweave_config, self.tp_group
        stages = self._stages()
        sp, is_moe = bool(self.config.sequence_parallel), any(s.is_moe for s in stages)
        (world, rank), hidden = self._tp, x.shape[-1]
        chunks = world if sp else 1
        rows = x.shape[0] * x.shape[1] * chunks  # tokens of the whole forward
        comm = get_communicator(group, cfg.max_tokens, hidden, x.dtype, x.device, cfg.backend)
        comm.check_capacity(rows)
        successor = self._chain.successor(self)
        first, last = handoff is None, successor is None
        if first:  # once per forward of a block: a failure recorded by an earlier one
            comm.raise_if_failed()
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        key = TableKey.of(x.device, world, hidden, x.dtype, sp, is_moe, capturing,
                          self._gemm_precision)
        plan = get_policy(cfg, key).plan(rows)
        fp8 = self._fp8_now()
        if plan.comm == "gemm" and (is_moe or (fp8 and sp)):
            why = ("MoE layers use the fused op, not the GEMM-fused mechanism (the expert layer "
                   "computes its partial sums itself)" if is_moe else
                   "FP8 GEMMs with sequence parallelism use the fused op, not the GEMM-fused "
                   "mechanism (its FP8 form quantizes a half's rows as one contiguous block: "
                   "the replicated layout)")
            log_once(f"gemm-fused:{why}", f"TokenWeave: {why}")
            plan = dataclasses.replace(plan, comm="fused")
        halves = plan_halves(rows // chunks, cfg, plan.split,
                             granule=fp8_gemm.FP8_ROWS if fp8 else 1)
        for stage in stages:  # before anything is launched
            if stage.is_moe:
                moe.check_capacity(stage.mixer, [chunks * h.rows for h in halves])
        # The copy-engine mirror and the GEMM-fused inbox are made eagerly: Megatron warms up
        # eagerly, then captures with the CUDA-graph table, so the first forward makes them when
        # that table can pick the mechanism too.
        graph_policy = None
        if not self._validated and not capturing and self._capturable():
            graph_policy = get_policy(cfg, dataclasses.replace(key, cuda_graphs=True))
        if plan.comm == "copy_engine" or (graph_policy and graph_policy.may_use("copy_engine")):
            comm.prepare_copy_engine()
        if plan.comm == "gemm" or (graph_policy and not is_moe and graph_policy.may_use("gemm")):
            comm.prepare_gemm()
        step = WovenForward(x, world, rank, sp, comm, plan, halves,
                            self._chain.side_stream(x.device), validate=not self._validated,
                            fp8=fp8)
        inputs, written = step.inputs(handoff, self.first_norm(), group, x, stages[0].column)
        residual = step.residual_in
        for k, stage in enumerate(stages):
            after = (stages[k + 1] if k + 1 < len(stages)
                     else None if last else successor._stages()[0])
            following = None if after is None else (
                getattr(self, after.norm_name) if k + 1 < len(stages) else successor.first_norm())
            next_norm = None if following is None else norm_weight_eps_in(following, x.dtype)
            ops = step.stage(stage, inputs, residual, next_norm, stage.mixer_kwargs(layer_kwargs),
                             site=self.layer_number * 2 + k, written=written,
                             target=step.fp8_target(after.column) if cfg.fp8_rows and after
                             else None)
            inputs, residual, written = ops.ops, step.residual_out, ops.written_input()
        defer = not last and cfg.defer_across_layers and not self._layer_graphs()
        handed = step.hand_off(ops, defer)
        if last:  # queued after every op of the block, captured into graphs with it
            comm.record_errors()
        else:
            self._chain.pending = handed
        self._validated = True
        return step.out

    def _capturable(self) -> bool:
        """Whether a CUDA graph can capture this layer (not an MoE layer whose dispatcher
        copies token counts to the host)."""
        return all(moe.padded(s.mixer) for s in self._stages() if s.is_moe)

    def _layer_graphs(self) -> bool:
        """Megatron captures this layer in CUDA graphs of its own (it gave the layer a
        `cudagraph_manager`: cuda_graph_impl="local", unless inference graphs are owned by the
        block): side-stream work may not outlive the layer, in the captures and in the eager
        forwards around them (a capture cannot wait on work issued before it began: CUDA's
        capture isolation). A graph of a whole block or model keeps the cross-layer deferral
        (its last layer joins)."""
        return hasattr(self, "cudagraph_manager")


def seal_chain(config: Any) -> None:
    """The next layer built with `config` starts a chain of its own: a stack calls this once
    its layers are built, so no hand-off crosses its end (a pipeline stage's last layer)."""
    if getattr(config, CHAIN_ATTR, None) is not None:
        object.__setattr__(config, CHAIN_ATTR, None)


class TokenWeaveTransformerLayer(WovenLayer, TransformerLayer):
    """TransformerLayer: GPTModel layers (attention + MLP or MoE), hybrid '*' (attention) and
    'G' (gated delta net) layers."""


class TokenWeaveMLPLayer(WovenLayer, MLPLayer):
    """MLPLayer: a hybrid stack's '-' layer (one dense MLP stage)."""


class TokenWeaveMoETransformerLayer(WovenLayer, MoETransformerLayer):
    """MoETransformerLayer: a hybrid stack's 'E' layer (one MoE stage)."""


class TokenWeaveMambaLayer(WovenLayer, MambaLayer):
    """MambaLayer: a hybrid stack's 'M' layer (one Mamba-2 stage: its scan runs on all rows,
    in_proj and out_proj per half)."""

    _returns_context = False


# The woven counterpart of each Megatron layer class a stack builds.
WOVEN_LAYERS: dict[type, type] = {
    TransformerLayer: TokenWeaveTransformerLayer,
    MLPLayer: TokenWeaveMLPLayer,
    MoETransformerLayer: TokenWeaveMoETransformerLayer,
    MambaLayer: TokenWeaveMambaLayer,
}
