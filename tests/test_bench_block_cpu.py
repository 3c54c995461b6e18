"""The block benchmark's hybrid rows time the same model as its GPT rows: the GPT block's layers
as a HybridModel stack, with its weights."""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.transformer_block import TransformerBlock

from megatron_tokenweave.bench.block import hybrid_blocks, model_class, parser
from megatron_tokenweave.bench.sdpa import SDPACoreAttention, with_sdpa
from megatron_tokenweave.config import TokenWeaveConfig
from megatron_tokenweave.cpu_compat import cpu_device_scope
from megatron_tokenweave.models import SHAPES, llama_config, stock_layer_spec

SHAPE = SHAPES["tiny"]
LAYERS = 2


def test_hybrid_blocks_compute_the_gpt_block(single_rank_group):
    """Both hybrid stacks (Megatron's local form and TokenWeave's) load the GPT block's state
    strictly, get the benchmark's SDPA attention, and give its output (fp32, 1e-5)."""
    torch.manual_seed(0)
    with cpu_device_scope():
        cfg = llama_config(SHAPE, LAYERS, 1)
        gpt = TransformerBlock(cfg, with_sdpa(stock_layer_spec(SHAPE, False))).eval()
        blocks = hybrid_blocks(SHAPE, LAYERS, 1, False, TokenWeaveConfig(), {},
                               gpt.state_dict(), with_sdpa)
        assert sorted(blocks) == ["local_hybrid", "tokenweave_hybrid"]
        seq = 37
        x = torch.randn(seq, 2, SHAPE.hidden)
        rope = RotaryEmbedding(kv_channels=cfg.kv_channels, rotary_percent=1.0)(seq)
        with torch.no_grad():
            want = gpt(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
            for name, block in blocks.items():
                block.eval()
                assert len(block.layers) == 2 * LAYERS
                cores = [m for m in block.modules() if isinstance(m, SDPACoreAttention)]
                assert len(cores) == LAYERS, name
                got = block(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_rows_name_their_model_class():
    assert model_class("tokenweave_hybrid") == model_class("te_hybrid") == "hybrid"
    assert model_class("tokenweave") == model_class("te_nocomm") == "gpt"
    assert parser().parse_args([]).model_classes == ["gpt"]
    assert parser().parse_args(["--model-classes", "gpt", "hybrid"]).model_classes == [
        "gpt", "hybrid"]
