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
from .digits import DIGIT_CLASS_NAMES, Digits, load_mnist5k, split_mnist5k
from .multiscenes import MultiScenes, make_multi_scene_pairs, make_multi_scenes
from .scenes import CLASS_NAMES, Scenes, make_scenes

__all__ = [
    "CLASS_NAMES", "Scenes", "make_scenes", "MultiScenes", "make_multi_scenes", "make_multi_scene_pairs",
    "ADE20K", "BLOODMNIST_CLASSES", "IMAGE_EXTENSIONS", "BloodMNIST", "ImageFolder", "ImageNetVal", "collate",
    "transform_label_map", "voc_to_pixel_box",
    "DIGIT_CLASS_NAMES", "Digits", "load_mnist5k", "split_mnist5k",
]
