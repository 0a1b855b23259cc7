"""Tree attention on more of transformers' causal LMs than the four the other tests build: each tiny random model,
drafted by a noisy copy of itself, decodes to its own greedy `generate` under a fixed tree and a dynamic one. These
are families a sweep of 74 configurations found identical (the refused ones: test_hf.py); a transformers release that
changes how one of them reads positions, masks or its cache fails here, not in a user's output."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from arborspec import SpeculativeDecoder

# sizes every config class is offered; each takes the names its __init__ knows
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=256, n_embd=32, n_layer=2, n_head=4,
              n_positions=256, n_ctx=256, ffn_dim=64, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, rotary_dim=4, tie_word_embeddings=False, eos_token_id=1, bos_token_id=None,
              pad_token_id=0)
ARCHITECTURES = {  # model type -> its own settings on top of COMMON
    "mistral": dict(sliding_window=None),
    "gemma": {},
    "phi": dict(partial_rotary_factor=0.5),
    "phi3": dict(sliding_window=None),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, alibi=False),
    "opt": dict(enable_bias=True, word_embed_proj_dim=32),
    "gptj": {},
    "gpt_bigcode": dict(multi_query=True),
    "stablelm": dict(partial_rotary_factor=0.5),
    "starcoder2": dict(sliding_window=None),
    "cohere": dict(logit_scale=1.0),
    "olmo2": {},
    "qwen3_moe": dict(decoder_sparse_step=1, mlp_only_layers=[]),
    "granite": dict(logits_scaling=2.0, residual_multiplier=0.5, embedding_multiplier=2.0, attention_multiplier=0.3),
}


def pair(model_type: str):
    """A random fp32 target whose greedy paths are no near-ties, and a draft that agrees with it most of the time."""
    config_class = CONFIG_MAPPING[model_type]
    known = inspect.signature(config_class.__init__).parameters
    config = config_class(**{k: v for k, v in COMMON.items() if k in known}, **ARCHITECTURES[model_type])
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(4.0)
        draft = copy.deepcopy(target)
        for p in draft.parameters():
            if p.numel() > 1:
                p.add_(0.2 * p.std() * torch.randn_like(p))
    return target.requires_grad_(False), draft.requires_grad_(False)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_trees_decode_to_the_models_own_greedy_output(model_type):
    target, draft = pair(model_type)
    prompt = [5, 6, 7, 8]
    with torch.no_grad():
        want = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, len(prompt):].tolist()
    for method, options in (("static", dict(depth=3, branch=2)), ("dynatree", {})):
        res = SpeculativeDecoder(target, draft, method=method, **options).generate(prompt, 40, ignore_eos=True)
        assert res.token_ids == want, (model_type, method)
        assert res.stats.acceptance_rate > 0  # the trees were used, not only their roots
