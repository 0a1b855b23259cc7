"""Tiny random Mamba2, Bamba and NemotronH models (fp32, the char tokenizer's 64-token vocabulary)."""
import torch
from transformers import AutoModelForCausalLM, BambaConfig, Mamba2Config, NemotronHConfig

from tests.conftest import VOCAB


def ssm_config(kind: str, vocab: int = VOCAB, heads: int = 4, head_dim: int = 8, state: int = 8, groups: int = 2):
    common = dict(vocab_size=vocab, hidden_size=32, pad_token_id=None, eos_token_id=1, bos_token_id=None)
    if kind == "mamba2":
        return Mamba2Config(num_hidden_layers=2, num_heads=heads, head_dim=head_dim, state_size=state, n_groups=groups,
                            expand=heads * head_dim // 32, chunk_size=8, **common)
    if kind == "bamba":  # mamba, attention, mamba, attention; each followed by an MLP
        return BambaConfig(intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           attn_layer_indices=[1, 3], mamba_n_heads=heads, mamba_d_head=head_dim, mamba_n_groups=groups,
                           mamba_d_state=state, mamba_expand=heads * head_dim // 32, mamba_chunk_size=8,
                           max_position_embeddings=512, **common)
    if kind == "nemotron_h":
        return NemotronHConfig(layers_block_type=["mamba", "attention", "mlp", "mamba"], num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, intermediate_size=64, ssm_state_size=state,
                               mamba_num_heads=heads, mamba_head_dim=head_dim, n_groups=groups, chunk_size=8, **common)
    raise ValueError(kind)


def ssm_model(kind: str = "mamba2", seed: int = 0, scale: float = 4.0, attn: str = "eager", **kw):
    """A random fp32 model whose decays, step sizes and skips are random too (the default init makes them uniform)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(ssm_config(kind, **kw), attn_implementation=attn, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith(".D"):
                p.copy_(torch.randn_like(p))
        model.get_output_embeddings().weight.mul_(scale)
    return model.eval().requires_grad_(False)
