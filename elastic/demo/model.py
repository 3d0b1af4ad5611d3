"""The demo's model: a small decoder-only transformer that predicts the next byte.

    model = TinyLM(ModelConfig(seq_len=128), seed=0)
    logits = model(tokens)            # tokens: (batch, seq) int64 in [0, 256) -> (batch, seq, 256)

Plain torch: token and learned position embeddings, `nn.TransformerEncoder` layers with a
causal mask (which makes them decoder blocks without cross-attention), a final norm, and an
output layer tied to the token embedding. The same seed always gives the same weights.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from elastic.demo.corpus import VOCAB_SIZE


class ModelConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    seq_len: int = Field(128, gt=0, description="Longest input the position embedding covers.")
    d_model: int = Field(128, gt=0, description="Width of the residual stream.")
    n_layers: int = Field(2, gt=0, description="Transformer blocks.")
    n_heads: int = Field(4, gt=0, description="Attention heads per block; must divide d_model.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout in the blocks; 0 keeps steps deterministic.")

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
        x = self.blocks(x, mask=self.causal_mask[:length, :length], is_causal=True)
        return self.head(self.norm(x))
