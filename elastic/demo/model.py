"""The demo's model: a small decoder-only transformer that predicts the next byte.

    model = TinyLM(ModelConfig(seq_len=128), seed=0)
    logits = model(tokens)            # tokens: (batch, seq) int64 in [0, 256) -> (batch, seq, 256)

Plain torch: token and learned position embeddings, `nn.TransformerEncoder` layers with a
causal mask (which makes them decoder blocks without cross-attention), a final norm, and an
output layer tied to the token embedding. The same seed always gives the same weights.

Tensor parallelism cannot cut these blocks' attention: nn.MultiheadAttention keeps q, k and v in
one fused `in_proj_weight` and reads its weights directly in its forward (see
`elastic.tensor_parallel`). `ModelConfig(attention="split")` builds the same blocks with
`elastic.tensor_parallel.SelfAttention` instead (separate q, k, v projections), which
`model.tensor_parallel_plan()` cuts by heads; the default model stays as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from elastic.demo.corpus import VOCAB_SIZE
from elastic.errors import ElasticError

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle


class ModelConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    seq_len: int = Field(128, gt=0, description="Longest input the position embedding covers.")
    d_model: int = Field(128, gt=0, description="Width of the residual stream.")
    n_layers: int = Field(2, gt=0, description="Transformer blocks.")
    n_heads: int = Field(4, gt=0, description="Attention heads per block; must divide d_model.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout in the blocks; 0 keeps steps deterministic.")
    attention: Literal["fused", "split"] = Field("fused", description=(
        "'fused': torch's nn.TransformerEncoderLayer, whose nn.MultiheadAttention holds q, k and v in one "
        "in_proj_weight; 'split': the same pre-norm blocks with separate q_proj, k_proj, v_proj Linears "
        "(elastic.tensor_parallel.SelfAttention), which tensor parallelism can cut by heads."))

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model({self.d_model}) is not divisible by n_heads({self.n_heads}); pick n_heads dividing it")
        return self


class TinyLM(nn.Module):
    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        # Seed a private generator instead of the global RNG: the weights depend on `seed`
        # alone, not on whatever the train loop drew from torch's RNG before.
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB_SIZE, config.d_model)
        self.position = nn.Embedding(config.seq_len, config.d_model)
        if config.attention == "split":
            self.blocks = nn.Sequential(*(SplitAttentionLayer(config) for _ in range(config.n_layers)))
        else:
            layer = nn.TransformerEncoderLayer(
                config.d_model, config.n_heads, dim_feedforward=4 * config.d_model, dropout=config.dropout,
                activation="gelu", batch_first=True, norm_first=True,
            )
            # enable_nested_tensor only helps with padding masks, and warns with norm_first.
            self.blocks = nn.TransformerEncoder(layer, config.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, VOCAB_SIZE, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(config.seq_len), persistent=False)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if param.dim() > 1:
                    param.normal_(0.0, 0.02, generator=generator)
                elif name.endswith("bias"):
                    param.zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.config.seq_len:
            raise ValueError(f"input of {length} tokens is longer than ModelConfig(seq_len={self.config.seq_len})")
        positions = torch.arange(length, device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        if self.config.attention == "split":
            x = self.blocks(x)  # each SelfAttention is causal
        else:
            x = self.blocks(x, mask=self.causal_mask[:length, :length], is_causal=True)
        return self.head(self.norm(x))

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """Megatron's cut of every block, for `elastic.tensor_parallel.TensorParallelModel`: attention by heads,
        the MLP by its hidden features. The embeddings, norms and the tied head stay whole on every rank."""
        from elastic.tensor_parallel import attention_plan, mlp_plan  # DTensor loads only for models that use it

        if self.config.attention != "split":
            raise ElasticError("TinyLM's default blocks use nn.MultiheadAttention, whose fused in_proj_weight tensor "
                               "parallelism cannot cut by heads: build it with ModelConfig(attention='split')")
        return {**attention_plan("blocks.*.self_attn"), **mlp_plan("blocks.*.linear1", "blocks.*.linear2")}


class SplitAttentionLayer(nn.Module):
    """nn.TransformerEncoderLayer(norm_first=True, activation="gelu", batch_first=True) with causal
    `SelfAttention` instead of nn.MultiheadAttention: the same names, but q_proj, k_proj (without a
    bias, which softmax ignores) and v_proj in place of the fused in_proj_weight and in_proj_bias."""

    def __init__(self, config: ModelConfig) -> None:
        from elastic.tensor_parallel import SelfAttention  # DTensor loads only for models that use it

        super().__init__()
        self.self_attn = SelfAttention(config.d_model, config.n_heads, causal=True, dropout=config.dropout)
        self.linear1 = nn.Linear(config.d_model, 4 * config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.linear2 = nn.Linear(4 * config.d_model, config.d_model)
        self.norm1 = nn.LayerNorm(config.d_model)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.dropout1 = nn.Dropout(config.dropout)
        self.dropout2 = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout1(self.self_attn(self.norm1(x)))
        return x + self.dropout2(self.linear2(self.dropout(nn.functional.gelu(self.linear1(self.norm2(x))))))
