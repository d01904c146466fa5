"""ModelConfig: one decoder-only family covering GPT-2, Llama, Mistral, Qwen2/3 and the MoE families
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, dots.llm1, GLM-4-MoE; DeepSeek-V3's router).

The architecture name fixes the structural choices that Hugging Face fixes per class (norm type,
position encoding, which projections carry biases), so that every valid config can be exported to
its HF class. The knobs HF exposes per checkpoint (sizes, GQA, RoPE theta and scaling, tying,
eps, sliding window, optional biases) are fields here with the same meaning.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mpformer.core.errors import ConfigError, format_choices
from mpformer.core.layer_spec import ATTENTION_KINDS, MLP_KINDS, mlp_kind
from mpformer.core.moe_config import MOE_ARCHS, QK_NORM_ARCHS, is_moe_layer, validate_moe

ARCHS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", *MOE_ARCHS)
ACTIVATIONS = ("gelu_tanh", "gelu", "swiglu")
NO_BIAS_ARCHS = ("mistral", "qwen3", "mixtral", "qwen3_moe", "olmoe")
WINDOW_ARCHS = ("mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "dots1")
# Optional biases on q, k, v (and o where out_proj_bias says), never on the MLP: dots.llm1, GLM-4-MoE.
OPTIONAL_QKV_BIAS_ARCHS = ("dots1", "glm4_moe")


@dataclass
class ModelConfig:
    arch: str = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_kv_heads: int | None = None  # None: as many as query heads (MHA)
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    activation: str = "swiglu"  # gpt2 uses gelu_tanh (HF "gelu_new")
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.x frequency scaling (HF rope_scaling rope_type="llama3"); factor None disables it.
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    # RoPE on the first int(head_dim * factor) dims of each head, the rest passed through (GLM-4-MoE: 0.5)
    partial_rotary_factor: float = 1.0
    tie_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v (gpt2, qwen2) and on o for gpt2/llama
    mlp_bias: bool = False
    sliding_window: int | None = None  # mistral/qwen2: attend to at most this many previous tokens
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    # What each block is made of (core/layer_spec.py registries): a new MLP or attention is a registered kind.
    mlp_kind: str = "dense"
    attention_kind: str = "self"
    # ---- mixture of experts (core/moe_config.py; HF's names where HF has one) ----------------
    num_experts: int = 0  # 0: a dense model; >0 with mlp_kind=moe on the sparse layers
    num_experts_per_tok: int = 2
    moe_ffn_hidden_size: int | None = None  # one expert's ffn width (HF moe_intermediate_size); None: ffn_size
    shared_expert_ffn_size: int = 0  # shared experts' total ffn width (Qwen2-MoE, DeepSeek); 0: none
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(gate(x)) scales the shared expert's output
    norm_topk_prob: bool = True  # renormalise the chosen k weights to sum to 1
    router_score: str = "softmax"  # softmax over experts then top-k | sigmoid (DeepSeek-V3)
    router_bias: bool = False  # DeepSeek-V3's selection bias (e_score_correction_bias): picks, never weighs
    router_groups: int = 1  # DeepSeek-V3 group-limited routing: experts in n_group groups ...
    router_topk_groups: int = 1  # ... of which the best topk_group are eligible
    routed_scaling_factor: float = 1.0
    router_aux_loss_coef: float = 0.0  # Switch/GShard load-balancing loss, E * sum_i f_i P_i per layer
    router_z_loss_coef: float = 0.0  # ST-MoE's router z-loss, mean logsumexp(logits)^2
    router_bias_update_rate: float = 0.0  # auxiliary-loss-free balancing: the bias's step (needs router_bias)
    capacity_factor: float | None = None  # None: dropless; else each expert takes at most cf * T * k / E slots
    decoder_sparse_step: int = 1  # Qwen-MoE: layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and it is not listed here ...
    first_k_dense: int = 0  # ... and i >= first_k_dense (DeepSeek's first_k_dense_replace)
    qk_norm: str | None = None  # RMSNorm on queries and keys before RoPE: "head" (Qwen3) | "projection" (OLMoE)

    # ---- derived structure -------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that RoPE rotates (HF: int(head_dim * partial_rotary_factor))."""
        return int(self.head_size * self.partial_rotary_factor)

    @property
    def norm_type(self) -> str:
        return "layernorm" if self.arch == "gpt2" else "rmsnorm"

    @property
    def learned_positions(self) -> bool:
        return self.arch == "gpt2"

    @property
    def gated_mlp(self) -> bool:
        return self.activation == "swiglu"

    @property
    def out_proj_bias(self) -> bool:
        """Bias on the attention output projection: HF Qwen2, Mistral and GLM-4-MoE never have one."""
        return self.attention_bias and self.arch in ("gpt2", "llama", "dots1")

    @property
    def norm_bias(self) -> bool:
        return self.norm_type == "layernorm"

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_size

    def layer_mlp_kind(self, layer: int) -> str:
        """The MLP kind of layer ``layer``: ``mlp_kind`` everywhere in a model without experts; in a mixture
        of experts, ``mlp_kind`` on the sparse layers and "dense" between them."""
        return self.mlp_kind if self.num_experts == 0 or is_moe_layer(self, layer) else "dense"

    def layer_kinds(self) -> list[str]:
        return [self.layer_mlp_kind(i) for i in range(self.num_layers)]

    # ---- checks and sizes ----------------------------------------------------------------
    def validate(self) -> ModelConfig:
        """Check the config on its own (layouts are checked by core.layout.validate)."""
        if self.arch not in ARCHS:
            raise ConfigError(f"model.arch={self.arch!r} is unknown; valid: {format_choices(ARCHS)}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(
                f"model.activation={self.activation!r} is unknown; valid: {format_choices(ACTIVATIONS)}"
            )
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 1")
        heads, kv = self.num_attention_heads, self.kv_heads
        if self.head_dim is None and self.hidden_size % heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by num_attention_heads={heads}; "
                f"set model.head_dim or use heads in {format_choices(divisors(self.hidden_size))}"
            )
        if kv < 1 or heads % kv:
            raise ConfigError(
                f"model.num_kv_heads={kv} must divide num_attention_heads={heads}; "
                f"valid: {format_choices(divisors(heads))}"
            )
        if self.head_size % 2 and not self.learned_positions:
            raise ConfigError(f"model head_dim={self.head_size} must be even for rotary embeddings")
        if self.partial_rotary_factor != 1.0 and (self.learned_positions or not 0 < self.partial_rotary_factor < 1
                                                  or self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ConfigError(f"model.partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and "
                              f"rotate an even number >= 2 of the head's {self.head_size} dims, with RoPE "
                              f"(arch={self.arch})")
        for key, table in (("mlp_kind", MLP_KINDS), ("attention_kind", ATTENTION_KINDS)):
            if getattr(self, key) not in table:
                raise ConfigError(f"model.{key}={getattr(self, key)!r} is not a registered kind; valid: "
                                  f"{format_choices(sorted(table))}")
        self._validate_arch()
        validate_moe(self)
        return self

    def check_sequence(self, seq_length: int, key: str = "train.seq_length") -> None:
        """A run's sequence length against the positions the model is built for, as Megatron checks it:
        a learned position table has no row past max_position_embeddings, and RoPE models are rejected
        the same way (their frequencies and any scaling are set for that length; raise the field to
        train longer)."""
        limit = self.max_position_embeddings
        if seq_length > limit:
            kind = "learned positions" if self.learned_positions else "rotary positions"
            raise ConfigError(f"{key}={seq_length} exceeds model.max_position_embeddings={limit} ({kind}, "
                              f"arch={self.arch}); valid: 1 <= {key} <= {limit}, or raise "
                              "model.max_position_embeddings")

    def _validate_arch(self) -> None:
        a = self.arch
        if a == "gpt2":
            if self.activation == "swiglu":
                raise ConfigError("model.activation=swiglu is not available for arch=gpt2; valid: gelu_tanh, gelu")
            if self.kv_heads != self.num_attention_heads:
                raise ConfigError("model.num_kv_heads must equal num_attention_heads for arch=gpt2 (no GQA)")
            if not (self.attention_bias and self.mlp_bias):
                raise ConfigError("arch=gpt2 has biases on every linear layer: set model.attention_bias and "
                                  "model.mlp_bias to true")
        else:
            if self.activation != "swiglu":
                raise ConfigError(f"model.activation={self.activation} is not available for arch={a}; "
                                  "valid: swiglu")
            if a in NO_BIAS_ARCHS and (self.attention_bias or self.mlp_bias):
                raise ConfigError(f"arch={a} has no linear biases: set model.attention_bias and "
                                  "model.mlp_bias to false")
            if a in ("qwen2", "qwen2_moe") and (not self.attention_bias or self.mlp_bias):
                raise ConfigError(f"arch={a} has biases on q, k, v only: set model.attention_bias=true "
                                  "and model.mlp_bias=false")
        if a in OPTIONAL_QKV_BIAS_ARCHS and self.mlp_bias:
            raise ConfigError(f"arch={a} has no MLP biases: set model.mlp_bias=false")
        if a == "glm4_moe" and self.qk_norm not in (None, "head"):
            raise ConfigError(f"model.qk_norm={self.qk_norm!r} is not available for arch=glm4_moe; valid: null, head")
        if a in QK_NORM_ARCHS and self.qk_norm != QK_NORM_ARCHS[a]:
            raise ConfigError(f"arch={a} normalises queries and keys per {QK_NORM_ARCHS[a]}: set "
                              f"model.qk_norm={QK_NORM_ARCHS[a]}")
        if self.sliding_window is not None and a not in WINDOW_ARCHS:
            raise ConfigError(f"model.sliding_window is not available for arch={a}; valid: "
                              f"{format_choices(WINDOW_ARCHS)}")

    def num_params(self) -> int:
        """Parameter count of the model as built (tied embeddings counted once)."""
        h, d = self.hidden_size, self.head_size
        q, kv = self.num_attention_heads * d, self.kv_heads * d
        attn = h * (q + 2 * kv) + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        if self.out_proj_bias:
            attn += h
        if self.qk_norm is not None:
            attn += 2 * d if self.qk_norm == "head" else q + kv
        norm = (2 if self.norm_bias else 1) * h
        mlps = sum(mlp_kind(k).params(self) for k in self.layer_kinds())
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        if self.learned_positions:
            embed += self.max_position_embeddings * h
        return self.num_layers * (attn + 2 * norm) + mlps + embed + norm

    def active_params(self) -> int:
        """Parameters one token's forward reads (MoE: its k routed experts, not all of them)."""
        if self.num_experts == 0:
            return self.num_params()
        sparse = sum(1 for k in self.layer_kinds() if k != "dense")
        per_expert = (3 if self.gated_mlp else 2) * self.hidden_size * self.expert_ffn_size
        return self.num_params() - sparse * (self.num_experts - self.num_experts_per_tok) * per_expert

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model config keys {unknown}; valid: {format_choices(sorted(known))}")
        return cls(**d)

    def shape_signature(self) -> dict[str, Any]:
        """The fields that decide tensor shapes: two configs that agree here can share weights."""
        keys = ("arch", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads",
                "ffn_hidden_size", "vocab_size", "head_dim", "tie_embeddings", "attention_bias",
                "mlp_bias", "activation", "mlp_kind", "attention_kind", "num_experts", "moe_ffn_hidden_size",
                "shared_expert_ffn_size", "shared_expert_gate", "router_bias", "decoder_sparse_step",
                "mlp_only_layers", "first_k_dense", "qk_norm")
        d = {k: getattr(self, k) for k in keys}
        d["num_kv_heads"], d["ffn_hidden_size"], d["head_dim"] = self.kv_heads, self.ffn_size, self.head_size
        if self.learned_positions:
            d["max_position_embeddings"] = self.max_position_embeddings
        return d


def divisors(n: int) -> list[int]:
    """1..n's divisors of n, ascending (valid degrees listed in error messages)."""
    return [i for i in range(1, n + 1) if n % i == 0]


def model_flops_per_step(model: ModelConfig, global_batch: int, seq: int) -> float:
    """Model FLOPs of one step (no recompute counted): 6 N T for the weights' GEMMs (embedding lookups
    excluded) plus attention's 12 L s d_q T (the full score matrix, as MFU conventions count it)."""
    n = model.active_params() - (0 if model.tie_embeddings else model.vocab_size * model.hidden_size)
    if model.learned_positions:
        n -= model.max_position_embeddings * model.hidden_size
    tokens = global_batch * seq
    return 6.0 * n * tokens + 12.0 * model.num_layers * seq * model.num_attention_heads * model.head_size * tokens

