"""What makes each decoder family differ from Llama, as data (design §9).

pdserve runs one decoder (`decoder.py`). A family is the few switches below plus the names
its checkpoints give their tensors; the numbers of one model (sizes, rotary bases, sliding
windows per layer) are `ModelArch`'s. Adding a family is adding an entry here and, where
its config says things in its own words, a line in `arch.py`: never a branch on its name.

    family   extra tensors               switches
    llama    -                           GGUF q/k rows interleaved by llama.cpp's converter
    mistral  -                           (as llama; a sliding window where its config has one)
    qwen2    q/k/v biases                -
    qwen3    q_norm, k_norm (per head)   -
    gemma3   q_norm, k_norm, a norm on   norms scale by (1 + w) in HF checkpoints; GeLU (tanh)
             each sublayer's output      MLP; embeddings scaled by sqrt(hidden); sliding layers
    phi3     -                           fused qkv and gate/up in its checkpoints; partial
                                         rotary and LongRoPE (ModelArch)

pdserve's module names are Llama's: `input_layernorm` before attention and
`post_attention_layernorm` before the MLP; the sublayer-output norms of Gemma are
`attn_out_norm` and `mlp_out_norm`. Each family maps its checkpoint names onto these.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.errors import ModelLoadError


class Activation(enum.Enum):
    SILU = "silu"
    """SwiGLU: silu(gate) * up."""
    GELU_TANH = "gelu_tanh"
    """GeGLU with the tanh approximation of GeLU (Gemma's `gelu_pytorch_tanh`)."""


# GGUF per-layer tensor names (llama.cpp's) -> pdserve's, for every family; a family's
# `gguf_layer_names` add to or override these.
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class Family:
    name: str
    hf_architectures: tuple[str, ...]
    """Hugging Face `architectures` entries this family reads."""
    gguf_architecture: str | None
    """`general.architecture` of its GGUF files (llama.cpp's name), if it has one of its
    own (Mistral's files say `llama`)."""
    qkv_bias: bool = False
    qk_norm: bool = False
    """An RMSNorm over each head of q and of k, before the rotary embedding."""
    sublayer_out_norms: bool = False
    """A norm on the attention's output and on the MLP's, before each joins the residual."""
    hf_norm_offset: float = 0.0
    """Hugging Face checkpoints store norm weights as w for a scale of (offset + w): folded
    in at load. llama.cpp's converter folds it already, so GGUF files need none."""
    activation: Activation = Activation.SILU
    scales_embeddings: bool = False
    """Embeddings times sqrt(hidden), in the compute dtype (Gemma)."""
    gguf_interleaved_qk: bool = False
    """llama.cpp's converter permutes q/k rows of this family for its interleaved rotary;
    the loader permutes them back (pdserve, like Hugging Face, rotates halves)."""
    sliding_rope: bool = False
    """Sliding layers turn with a rotary base of their own, unscaled (Gemma 3: 10000)."""
    gguf_sliding_pattern: int = 0
    """How llama.cpp lays out the sliding layers of a file with a window and no explicit
    pattern: every n-th layer attends fully (Gemma 3: 6), or 0: every layer slides."""
    gguf_scale_by_hidden_at: tuple[int, ...] = ()
    """GGUF keeps no score scale: llama.cpp takes head_dim ** -0.5, or (hidden / heads)
    ** -0.5 for the models with these layer counts (Gemma 3 27B: 62)."""
    hf_names: tuple[tuple[str, str], ...] = ()
    """Renames of a layer's Hugging Face tensor names (a suffix after `layers.N.`)."""
    gguf_layer_names: tuple[tuple[str, str], ...] = ()
    """Additions to and overrides of `GGUF_LAYER_NAMES` for this family's files."""

    def hf_name(self, name: str) -> str:
        """A Hugging Face checkpoint's tensor name in pdserve's words."""
        for old, new in self.hf_names:
            if f".{old}." in name:
                return name.replace(f".{old}.", f".{new}.")
        return name

    def gguf_layer_name(self, name: str) -> str | None:
        """pdserve's name for a per-layer GGUF tensor (after `blk.N.`), or None."""
        return dict(self.gguf_layer_names).get(name) or GGUF_LAYER_NAMES.get(name)


FAMILIES = {
    f.name: f
    for f in (
        Family("llama", ("LlamaForCausalLM",), "llama", gguf_interleaved_qk=True),
        Family("mistral", ("MistralForCausalLM",), None, gguf_interleaved_qk=True),
        Family("qwen2", ("Qwen2ForCausalLM",), "qwen2", qkv_bias=True),
        Family("qwen3", ("Qwen3ForCausalLM",), "qwen3", qk_norm=True),
        Family(
            "gemma3",
            ("Gemma3ForCausalLM",),
            "gemma3",
            qk_norm=True,
            sublayer_out_norms=True,
            hf_norm_offset=1.0,
            activation=Activation.GELU_TANH,
            scales_embeddings=True,
            sliding_rope=True,
            gguf_sliding_pattern=6,
            gguf_scale_by_hidden_at=(62,),
            hf_names=(
                ("post_attention_layernorm", "attn_out_norm"),
                ("pre_feedforward_layernorm", "post_attention_layernorm"),
                ("post_feedforward_layernorm", "mlp_out_norm"),
            ),
            gguf_layer_names=(
                ("post_attention_norm.weight", "attn_out_norm.weight"),
                ("post_ffw_norm.weight", "mlp_out_norm.weight"),
            ),
        ),
        Family(
            "phi3",
            ("Phi3ForCausalLM",),
            "phi3",
            # llama.cpp keeps Phi-3's fused gate/up as one `ffn_up` of twice the rows.
            gguf_layer_names=(("ffn_up.weight", "mlp.gate_up_proj.weight"),),
        ),
    )
}
HF_ARCHITECTURES = {a: f for f in FAMILIES.values() for a in f.hf_architectures}
GGUF_ARCHITECTURES = {f.gguf_architecture: f for f in FAMILIES.values() if f.gguf_architecture}


def family_for_hf(architectures: list[str], model_type: object) -> Family:
    family = next((HF_ARCHITECTURES[n] for n in architectures if n in HF_ARCHITECTURES), None)
    if family is None:
        raise ModelLoadError(
            f"unsupported architecture {architectures or model_type!r}; "
            f"pdserve supports {sorted(HF_ARCHITECTURES)}"
        )
    return family


def family_for_gguf(architecture: object) -> Family:
    family = GGUF_ARCHITECTURES.get(str(architecture))
    if family is None:
        raise ModelLoadError(
            f"unsupported GGUF architecture {architecture!r}; "
            f"supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    return family
