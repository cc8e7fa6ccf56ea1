"""The DINOv3 model: backbone, heads, released-weight I/O and scale-out wrappers. See docs/model.md."""

from .arch_inference import infer_backbone_kwargs
from .heads import DINOHead
from .parallel import apply_activation_checkpointing, apply_fsdp, compile_blocks
from .released import (
    WarmStart,
    backbone_state_dict,
    build_student_teacher_from_released,
    load_released_backbone,
    read_backbone_state_dict,
    save_backbone,
)
from .state_dict_check import ReleasedWeightsError
from .vision_transformer import (
    HUB_SETTINGS,
    PRESETS,
    RELEASED,
    DinoVisionTransformer,
    backbone_kwargs,
    build_backbone,
)

__all__ = [
    "HUB_SETTINGS",
    "PRESETS",
    "RELEASED",
    "DINOHead",
    "DinoVisionTransformer",
    "ReleasedWeightsError",
    "WarmStart",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "backbone_kwargs",
    "backbone_state_dict",
    "build_backbone",
    "build_student_teacher_from_released",
    "compile_blocks",
    "infer_backbone_kwargs",
    "load_released_backbone",
    "read_backbone_state_dict",
    "save_backbone",
]
