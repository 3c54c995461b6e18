"""TokenWeaveTransformerLayer: Megatron's TransformerLayer with the woven schedule of DESIGN.md.

Per layer, with the tokens split in halves A and B (rows of every chunk; a chunk is one rank's
sequence shard, or all rows without sequence parallelism):

    main stream                          side stream
    qkv(A)                               fused op(B) of the previous layer's MLP (deferred)
    qkv(B), attention (whole), proj(A)
    proj(B)                              fused op(A): all-reduce + add + pre-MLP RMSNorm
    MLP(A)                               fused op(B)
    MLP(B)                               fused op(A): all-reduce + add + next layer's RMSNorm
                                         fused op(B) -> handed to the next layer

Below the split threshold there is one half and the fused op runs on the main stream. On the
copy-engine data path (where it gathers no normed rows) the side stream only moves the peers'
rows (copy engines, no SMs beside the GEMM) and the reduction + norm runs on the main stream just
before the rows are consumed (schedule.Pending).
Where the fused path does not apply, the stock TransformerLayer.forward runs (logged once).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_tokenweave import moe
from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.linears import Weave, WovenLinearMixin
from megatron_tokenweave.log import log_once
from megatron_tokenweave.norm import norm_weight_eps, norm_weight_eps_in
from megatron_tokenweave.ops import Layout, fused_allreduce_rmsnorm
from megatron_tokenweave.ops.validate import (
    KERNEL_DTYPES,
    SUPPORTED_DTYPES,
    VECTOR_ELEMS,
    phases_apply,
)
from megatron_tokenweave.policy import TableKey, get_policy
from megatron_tokenweave.schedule import (
    Half,
    Handoff,
    Pending,
    WeaveChain,
    gemm_sm_carveout,
    plan_halves,
)
from megatron_tokenweave.workspace import get_workspace

_CHAIN_ATTR = "_tokenweave_last_built_layer"


class TokenWeaveTransformerLayer(TransformerLayer):
    """A TransformerLayer whose row-parallel all-reduces and the norms after them are fused and
    overlapped with the other half of the tokens. Same parameters and checkpoint keys as the
    stock layer built from the same spec.
    """

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

    def _accept_stock_norm_keys(self, state_dict: dict, prefix: str, *_: Any) -> None:
        """Load TE-spec state dicts, whose norm weights live in the fused TE linears. Our
        separate TE norms carry an `_extra_state` (quantization metadata) that such a state
        dict cannot have: they keep their own."""
        for ours, theirs in self.submodules_config.sharded_state_dict_keys_map.items():
            for suffix in ("weight", "bias"):
                stock_key, our_key = prefix + theirs + suffix, prefix + ours + suffix
                if stock_key in state_dict and our_key not in state_dict:
                    state_dict[our_key] = state_dict.pop(stock_key)
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            norm = getattr(self, name)
            extra_key = f"{prefix}{name}._extra_state"
            has_extra = type(norm).get_extra_state is not torch.nn.Module.get_extra_state
            if has_extra and extra_key not in state_dict and f"{prefix}{name}.weight" in state_dict:
                state_dict[extra_key] = norm.get_extra_state()

    # ----------------------------------------------------------------- construction
    def _join_chain(self) -> WeaveChain:
        """Share the chain of the layer built just before this one, if it is our predecessor."""
        ref = getattr(self.config, _CHAIN_ATTR, None)
        prev = ref() if ref is not None else None
        object.__setattr__(self.config, _CHAIN_ATTR, weakref.ref(self))
        if (
            isinstance(prev, TokenWeaveTransformerLayer)
            and prev.layer_number == self.layer_number - 1
            and prev.tp_group is self.tp_group
        ):
            prev._chain.link(prev, self)
            return prev._chain
        return WeaveChain()

    # ----------------------------------------------------------------- policy
    def _unsupported_reason(self, hidden_states: torch.Tensor) -> str | None:
        """Why the fused path cannot run this call (None when it can)."""
        cfg = self.config
        if self.tp_group is None or dist.get_world_size(self.tp_group) < 2:
            return "tensor-parallel size is 1"
        if torch.is_grad_enabled():
            return "gradients are enabled (TokenWeave is an inference schedule)"
        if cfg.normalization != "RMSNorm":
            return f"normalization is {cfg.normalization}, the fused op is RMSNorm"
        if (
            norm_weight_eps(self.input_layernorm) is None
            or norm_weight_eps(self.pre_mlp_layernorm) is None
        ):
            return "the layer's norms are not plain RMSNorm modules"
        if hidden_states.dtype not in SUPPORTED_DTYPES:
            return f"dtype {hidden_states.dtype} is not supported"
        if hidden_states.dtype not in KERNEL_DTYPES and hidden_states.is_cuda:
            return f"the CUDA kernel takes bf16/fp16, not {hidden_states.dtype}"
        if cfg.hidden_size % VECTOR_ELEMS != 0:
            return f"hidden size {cfg.hidden_size} is not a multiple of {VECTOR_ELEMS}"
        if cfg.fp32_residual_connection:
            return "fp32_residual_connection is set"
        if cfg.context_parallel_size > 1:
            return "context parallelism is not supported"
        if getattr(cfg, "fp8", None) or getattr(cfg, "fp4", None):
            return "fp8/fp4 GEMMs are not supported"
        if not isinstance(self.cross_attention, IdentityOp):
            return "cross-attention layers are not supported"
        linears = [
            getattr(self.self_attention, "linear_qkv", None),
            getattr(self.self_attention, "linear_proj", None),
        ]
        if moe.is_moe(self.mlp):
            reason = moe.unsupported_reason(self.mlp)
            if reason is not None:
                return reason
        else:
            linears += [getattr(self.mlp, name, None) for name in ("linear_fc1", "linear_fc2")]
        if not all(isinstance(m, WovenLinearMixin) for m in linears):
            return "the attention/MLP linears are not TokenWeave linears"
        if hidden_states.dim() != 3 or not hidden_states.is_contiguous():
            return "hidden_states is not a contiguous [s, b, h] tensor"
        return None

    # ----------------------------------------------------------------- forward
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        handoff = self._chain.claim(hidden_states)
        reason = self._unsupported_reason(hidden_states)
        if reason is not None:
            log_once(f"fallback:{reason}", f"TokenWeave: stock TransformerLayer path ({reason})")
            if handoff is not None:
                handoff.wait()  # the stock path reads the residual on the current stream
            return super().forward(hidden_states, *args, **kwargs)
        try:
            if args:
                raise TypeError("TokenWeaveTransformerLayer takes the layer's arguments by keyword")
            return self._woven_forward(hidden_states, handoff, kwargs), kwargs.get("context")
        except BaseException:
            if handoff is not None:
                handoff.wait()  # the predecessor's rows are complete even when this layer fails
            raise

    def _woven_forward(
        self, x: torch.Tensor, handoff: Handoff | None, attn_kwargs: dict[str, Any]
    ) -> torch.Tensor:
        cfg = self.tokenweave_config
        group = self.tp_group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        sp = bool(self.config.sequence_parallel)
        layout = Layout.SEQUENCE_PARALLEL if sp else Layout.REPLICATED
        s_local, batch, hidden = x.shape
        chunks, n = (world if sp else 1), s_local * batch
        ws = get_workspace(group, cfg.max_tokens, hidden, x.dtype, x.device, cfg.backend)
        ws.check_capacity(chunks * n)
        if handoff is None:  # once per forward of a block: its first layer
            ws.raise_if_kernel_failed()
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        key = TableKey.of(x.device, world, hidden, x.dtype, sp, moe.is_moe(self.mlp), capturing)
        plan = get_policy(cfg, key).plan(chunks * n)
        halves = plan_halves(n, cfg, plan.split)
        if moe.is_moe(self.mlp):  # before anything is launched
            moe.check_capacity(self.mlp, [chunks * h.rows for h in halves])
        side = self._chain.side_stream(x.device)
        split = len(halves) > 1

        normed = ws.normed[: chunks * n].view(chunks, n, hidden)
        partials = tuple(
            ws.partial[chunks * h.offset : chunks * (h.offset + h.rows)].view(
                chunks, h.rows, hidden
            )
            for h in halves
        )
        residual_in = x.view(n, hidden)
        out = torch.empty_like(x)
        residual = out.view(n, hidden)

        inputs = self._inputs(handoff, halves, normed)
        if inputs is None:
            self._input_norm(x, normed, sp)
            inputs = tuple(Pending() for _ in halves)

        validate = not self._validated  # until a forward got through its checks
        if validate and not capturing and ws.backend == "kernel" and self._capturable():
            # Megatron warms up eagerly, then captures with the CUDA-graph table: if that table
            # can pick the copy-engine path, its mirror must exist before the capture.
            captured = dataclasses.replace(key, cuda_graphs=True)
            if get_policy(cfg, captured).may_copy_engine:
                ws.copy_engine_mirror()

        def launch(i: int, src: torch.Tensor, norm: tuple | None, ctas: int, ops: list) -> None:
            """Half i's fused op: on the main stream when unsplit, else on the side stream; the
            copy-engine op there only moves the rows, its reduction waits for the consumer."""
            half = halves[i]
            rows = slice(half.offset, half.offset + half.rows)
            weight, eps = norm if norm is not None else (None, 0.0)
            normed_out = half.of(normed) if weight is not None else None
            args = (ws, partials[i], src[rows], weight, eps, residual[rows], normed_out, layout)
            if not split:
                fused_allreduce_rmsnorm(*args, plan.comm_ctas_alone, validate, plan.comm)
                ops.append(Pending())
                return
            if plan.comm == "copy_engine" and phases_apply(layout, weight):
                with side.run():
                    fused_allreduce_rmsnorm(*args, ctas, validate, plan.comm, "transfer")
                ops.append(Pending(side.record(), lambda: fused_allreduce_rmsnorm(
                    *args, ctas, validate, plan.comm, "reduce")))
                return
            with side.run():
                fused_allreduce_rmsnorm(*args, ctas, validate, plan.comm)
            ops.append(Pending(side.record()))

        # The split GEMMs may leave SMs to the kernel beside them (plan.gemm_sm_carveout).
        with gemm_sm_carveout(plan.gemm_sm_carveout if split else 0):
            # Attention: qkv per half as its input arrives, attention whole, proj per half.
            attn_ops: list[Pending] = []
            pre_mlp = norm_weight_eps_in(self.pre_mlp_layernorm, x.dtype)
            attention = self.self_attention
            attention.linear_qkv.weave = Weave(
                chunks, halves, before=lambda i: inputs[i].wait()
            )
            attention.linear_proj.weave = Weave(
                chunks,
                halves,
                partials=partials,
                add_bias=rank == 0,
                after=lambda i: launch(i, residual_in, pre_mlp, plan.comm_ctas_attn, attn_ops),
            )
            try:
                attention(
                    normed.view(chunks * s_local, batch, hidden), **_attention_kwargs(attn_kwargs)
                )
            finally:
                attention.linear_qkv.weave = attention.linear_proj.weave = None

            # MLP per half; its fused op also applies the next layer's input norm when there is one.
            successor = self._chain.successor(self)
            next_norm = (
                norm_weight_eps_in(successor.input_layernorm, x.dtype)
                if successor is not None
                else None
            )
            mlp_ops: list[Pending] = []
            for i, half in enumerate(halves):
                attn_ops[i].wait()
                self._mlp_half(half.of(normed), partials[i], rank == 0)
                launch(i, residual, next_norm, plan.comm_ctas_mlp, mlp_ops)

        defer = next_norm is not None and cfg.defer_across_layers and not self._layer_graphs()
        if not defer:
            for op in mlp_ops:
                op.wait()
            mlp_ops = [Pending() for _ in halves]  # a capture may not wait on another's events
        if next_norm is not None:
            self._chain.pending = Handoff(out, normed, halves, tuple(mlp_ops))
        self._validated = True
        return out

    def _mlp_half(self, x: torch.Tensor, partial: torch.Tensor, add_bias: bool) -> None:
        """partial[C, r, H] <- this rank's un-reduced MLP output of the rows x[C, r, H]."""
        if moe.is_moe(self.mlp):
            moe.moe_partial(self.mlp, x, partial)
            return
        mlp, whole = self.mlp, (Half(0, x.shape[1]),)
        mlp.linear_fc1.weave = Weave(x.shape[0], whole)
        mlp.linear_fc2.weave = Weave(x.shape[0], whole, partials=(partial,), add_bias=add_bias)
        try:
            mlp(x)
        finally:
            mlp.linear_fc1.weave = mlp.linear_fc2.weave = None

    def _capturable(self) -> bool:
        """Whether a CUDA graph can capture this layer (not an MoE layer whose dispatcher
        copies token counts to the host)."""
        return not moe.is_moe(self.mlp) or moe.padded(self.mlp)

    def _layer_graphs(self) -> bool:
        """Megatron captures this layer in CUDA graphs of its own (it gave the layer a
        `cudagraph_manager`: cuda_graph_impl="local", unless inference graphs are owned by the
        block): side-stream work may not outlive the layer, in the captures and in the eager
        forwards around them (a capture cannot wait on work issued before it began: CUDA's
        capture isolation). A graph of a whole block or model keeps the cross-layer deferral
        (its last layer joins)."""
        return hasattr(self, "cudagraph_manager")

    @staticmethod
    def _inputs(handoff: Handoff | None, halves: tuple[Half, ...],
                normed: torch.Tensor) -> tuple[Pending, ...] | None:
        """Per half, the op still writing the handed-off normed input into `normed`; None:
        compute it here (no hand-off, or one into another buffer: a workspace outgrown
        between the two layers)."""
        if handoff is None:
            return None
        if handoff.normed.data_ptr() != normed.data_ptr() or handoff.normed.shape != normed.shape:
            handoff.wait()
            return None
        if handoff.halves == halves:
            return handoff.pending
        handoff.wait()
        return tuple(Pending() for _ in halves)

    def _input_norm(self, x: torch.Tensor, normed: torch.Tensor, sp: bool) -> None:
        """normed[C, n, H] <- the input norm of every row (gathered under sequence parallelism)."""
        local = self.input_layernorm(x).reshape(-1, x.shape[-1]).to(normed.dtype)
        if sp:
            flat = normed.view(-1, x.shape[-1])
            dist.all_gather_into_tensor(flat, local.contiguous(), group=self.tp_group)
        else:
            normed[0].copy_(local)


_ATTENTION_KEYS = (
    "attention_mask",
    "inference_context",
    "rotary_pos_emb",
    "rotary_pos_cos",
    "rotary_pos_sin",
    "rotary_pos_cos_sin",
    "attention_bias",
    "packed_seq_params",
    "sequence_len_offset",
)


def _attention_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The layer's keyword arguments that SelfAttention.forward takes."""
    kwargs = dict(kwargs)
    if kwargs.get("inference_context") is None and kwargs.get("inference_params") is not None:
        kwargs["inference_context"] = kwargs["inference_params"]
    return {k: kwargs[k] for k in _ATTENTION_KEYS if k in kwargs}
