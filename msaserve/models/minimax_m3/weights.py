"""Checkpoint tensor names of MiniMax-M3 → msaserve's parameters (transformers' text-model names).

Two layouts are read. MiniMax's release layout (what transformers writes for the VL model):
`language_model.model.layers.{i}.block_sparse_moe.experts.{j}.w1/w2/w3.weight` (one tensor per
expert, stacked here), `block_sparse_moe.gate`, `.e_score_correction_bias`, `.shared_experts`,
`mlp.gate_proj` / `mlp.up_proj` (fused here into gate_up), `self_attn.index_{q,k}_{proj,norm}`.
transformers' own layout (what it writes for the text-only model): `model.layers.{i}.mlp.experts.
gate_up_proj` [E, 2I, H] etc., which already are our names under `model.`.
"""

import re

from msaserve.models.checkpoint_plan import IGNORED, VISION, Piece

_VISION_PREFIXES = (
    "vision_tower.", "multi_modal_projector.", "patch_merge_mlp.",
    "model.vision_tower.", "model.multi_modal_projector.",
)
_TEXT_PREFIXES = (("language_model.model.", ""), ("model.language_model.", ""), ("model.", ""))
_LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")
_EXPERT = re.compile(r"^layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_HALVES = re.compile(
    r"^(layers\.\d+\.(?:mlp|block_sparse_moe\.shared_experts))\.(gate_proj|up_proj)\.weight$"
)
_RENAMES = (
    (re.compile(r"\.block_sparse_moe\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.block_sparse_moe\.(experts|gate|shared_experts)\."), r".mlp.\1."),
    (re.compile(r"\.self_attn\.index_(q|k)_(proj|norm)\."), r".self_attn.indexer.\1_\2."),
)


def m3_piece(name: str) -> Piece | str:
    """Where checkpoint tensor `name` goes: a Piece of one parameter, VISION (the vision tower's,
    loaded by the tower), IGNORED (multi-token-prediction heads, unused for serving, as in
    transformers) or the name unchanged when it is no M3 text weight (the caller reports it)."""
    if name in _LM_HEADS:
        return Piece("lm_head.weight")
    if name.startswith(_VISION_PREFIXES):
        return VISION
    if name.startswith("mtp.") or ".mtp." in name:
        return IGNORED
    for prefix, replacement in _TEXT_PREFIXES:
        if name.startswith(prefix):
            inner = replacement + name[len(prefix):]
            break
    else:
        return name
    if match := _EXPERT.match(inner):
        layer, expert, which = match.groups()
        if which == "w2":
            return Piece(f"layers.{layer}.mlp.experts.down_proj", expert=int(expert))
        half = 0 if which == "w1" else 1
        return Piece(f"layers.{layer}.mlp.experts.gate_up_proj", expert=int(expert), half=half)
    if match := _HALVES.match(inner):
        module, which = match.groups()
        module = module.replace(".block_sparse_moe.", ".mlp.")
        return Piece(f"{module}.gate_up_proj.weight", half=0 if which == "gate_proj" else 1)
    for pattern, replacement in _RENAMES:
        inner = pattern.sub(replacement, inner)
    return Piece(inner)
