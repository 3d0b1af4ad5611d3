"""The demo's model: a small decoder-only transformer that predicts the next byte.

    model = TinyLM(ModelConfig(seq_len=128), seed=0)
    logits = model(tokens)            # tokens: (batch, seq) int64 in [0, 256) -> (batch, seq, 256)

Plain torch: token and learned position embeddings, `nn.TransformerEncoder` layers with a
causal mask (which makes them decoder blocks without cross-attention), a final norm, and an
output layer tied to the token embedding. The same seed always gives the same weights.

Tensor parallelism cannot cut these blocks' attention: nn.MultiheadAttention keeps q, k and v in
one fused `in_proj_weight` and reads its weights directly in its forward (see
`elastic.parallel.tensor_parallel`). `ModelConfig(attention="split")` builds the same blocks with
`elastic.parallel.tensor_parallel.SelfAttention` instead (separate q, k, v projections), which
`model.tensor_parallel_plan()` cuts by heads; the default model stays as it was.

Pipeline parallelism needs the model as an nn.Sequential with one tensor between layers:
`model.pipeline_layers()` gives the same layers in that form (embedding with positions, each block
with its causal mask, then norm and output layer), with the output layer untied from the embedding
(see its docstring), and `next_byte_loss` is the loss the last stage computes:

    layers = TinyLM(ModelConfig(), seed=0).pipeline_layers()
    inputs, targets = next_byte_pairs(windows)   # windows: (batch, seq + 1) bytes
    loss = next_byte_loss(layers(inputs), targets)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
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
        "(elastic.parallel.tensor_parallel.SelfAttention), which tensor parallelism can cut by heads."))

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
        x = _embedded(tokens, self.embed, self.position)
        length = tokens.shape[1]
        if self.config.attention == "split":
            x = self.blocks(x)  # each SelfAttention is causal
        else:
            x = self.blocks(x, mask=self.causal_mask[:length, :length], is_causal=True)
        return self.head(self.norm(x))

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """Megatron's cut of every block, for `elastic.parallel.tensor_parallel.TensorParallelModel`: attention
        by heads, the MLP by its hidden features. The embeddings, norms and the tied head stay whole on every rank."""
        from elastic.parallel.tensor_parallel import attention_plan, mlp_plan  # DTensor loads only for models using it

        if self.config.attention != "split":
            raise ElasticError("TinyLM's default blocks use nn.MultiheadAttention, whose fused in_proj_weight tensor "
                               "parallelism cannot cut by heads: build it with ModelConfig(attention='split')")
        return {**attention_plan("blocks.*.self_attn"), **mlp_plan("blocks.*.linear1", "blocks.*.linear2")}

    def pipeline_layers(self) -> nn.Sequential:
        """This model as pipeline layers, for `ctx.prepare_model(layers, loss_fn=next_byte_loss)` with
        ScalingConfig(pipeline_stages > 1): `embed` (tokens to vectors, positions added), `block0` ...
        `block{n_layers - 1}` (each applying the causal mask itself), and `head` (the final norm, then the
        output layer), one tensor flowing between them. They compute what `forward` computes.

        The output layer is untied: its weight starts as a copy of the token embedding's and trains on
        its own from there. Tied, it is one parameter used by the first layer and the last, which a
        pipeline places on different stages, in different processes: each would hold its own copy and
        nothing would add the head's gradient to the embedding's. So the pipelined LM has VOCAB_SIZE x
        d_model parameters more, and its loss departs from the tied model's after the first step.

        The layers are this model's own modules, not copies (the head's output layer excepted): train
        one or the other, not both.
        """
        if self.config.attention == "split":
            blocks = list(self.blocks)  # each SelfAttention is causal
        else:
            blocks = [CausalBlock(layer, self.causal_mask) for layer in self.blocks.layers]
        tied = self.embed.weight
        output = nn.Linear(self.config.d_model, VOCAB_SIZE, bias=False, device=tied.device, dtype=tied.dtype)
        with torch.no_grad():
            output.weight.copy_(tied)
        return nn.Sequential(OrderedDict([
            ("embed", PipelineEmbedding(self.embed, self.position)),
            *((f"block{i}", block) for i, block in enumerate(blocks)),
            ("head", PipelineHead(self.norm, output)),
        ]))


def next_byte_pairs(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of seq_len + 1 bytes as (inputs, targets): each position's target is the next byte."""
    tokens = windows.long()
    return tokens[:, :-1], tokens[:, 1:]


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of every position's next-byte prediction."""
    return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))


def _embedded(tokens: torch.Tensor, embed: nn.Embedding, position: nn.Embedding) -> torch.Tensor:
    length = tokens.shape[1]
    if length > position.num_embeddings:
        raise ValueError(f"input of {length} tokens is longer than ModelConfig(seq_len={position.num_embeddings})")
    return embed(tokens) + position(torch.arange(length, device=tokens.device))


class PipelineEmbedding(nn.Module):
    """TinyLM's first layer in a pipeline: token ids to token plus position embeddings."""

    def __init__(self, embed: nn.Embedding, position: nn.Embedding) -> None:
        super().__init__()
        self.embed, self.position = embed, position

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _embedded(tokens, self.embed, self.position)


class CausalBlock(nn.Module):
    """One nn.TransformerEncoderLayer with TinyLM's causal mask: nn.TransformerEncoder passes the mask
    to its layers, and a pipeline runs the layers without it."""

    def __init__(self, layer: nn.TransformerEncoderLayer, causal_mask: torch.Tensor) -> None:
        super().__init__()
        self.layer = layer
        self.register_buffer("causal_mask", causal_mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        return self.layer(x, src_mask=self.causal_mask[:length, :length], is_causal=True)


class PipelineHead(nn.Module):
    """TinyLM's last layer in a pipeline: the final norm, then the output layer to the vocabulary's logits."""

    def __init__(self, norm: nn.LayerNorm, output: nn.Linear) -> None:
        super().__init__()
        self.norm, self.output = norm, output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x))


class SplitAttentionLayer(nn.Module):
    """nn.TransformerEncoderLayer(norm_first=True, activation="gelu", batch_first=True) with causal
    `SelfAttention` instead of nn.MultiheadAttention: the same names, but q_proj, k_proj (without a
    bias, which softmax ignores) and v_proj in place of the fused in_proj_weight and in_proj_bias."""

    def __init__(self, config: ModelConfig) -> None:
        from elastic.parallel.tensor_parallel import SelfAttention  # DTensor loads only for models that use it

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
