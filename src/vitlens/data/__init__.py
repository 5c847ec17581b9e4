"""Data: synthetic scenes with pixel-exact ground truth (the proving ground) and loaders for real data sets on disk."""

from .loaders import (
    ADE20K,
    BLOODMNIST_CLASSES,
    IMAGE_EXTENSIONS,
    BloodMNIST,
    ImageFolder,
    ImageNetVal,
    collate,
    transform_label_map,
    voc_to_pixel_box,
)
from .scenes import CLASS_NAMES, Scenes, make_scenes

__all__ = [
    "CLASS_NAMES", "Scenes", "make_scenes",
    "ADE20K", "BLOODMNIST_CLASSES", "IMAGE_EXTENSIONS", "BloodMNIST", "ImageFolder", "ImageNetVal", "collate",
    "transform_label_map", "voc_to_pixel_box",
]
