"""Caltech-256 from its standard folder tree, as ``tf.data`` pipelines, with the
split of Lee, Alvarez-Melis & Jaakkola (ICLR 2019, Appendix I): per class 5
validation and 15 test images drawn with a seed, the rest for training; images
resized to 299 x 299.

Expected layout (the extracted ``256_ObjectCategories.tar``)::

    256_ObjectCategories/
        001.ak47/001_0001.jpg ...
        002.american-flag/...
        ...
        256.toad/...
        257.clutter/...        (skipped: not one of the 256 object classes)

Files in a class folder that are not decodable images (stray text files, empty or
truncated JPEGs, sub-folders) are skipped, counted and reported, never fatal; a
class folder left without images is an error. `make_synthetic_caltech256` writes a
small tree of generated JPEGs in the same layout for tests and ``--quick`` runs.

TensorFlow is imported when a function that needs it is called, not when this
module is imported.
"""

from keras_roll.data.caltech256.pipeline import (
    Caltech256Splits,
    caltech256_dataset,
    caltech256_splits,
    load_caltech256,
)
from keras_roll.data.caltech256.synthetic import make_synthetic_caltech256
from keras_roll.data.caltech256.tree import (
    PAPER_IMAGE_SIZE,
    PAPER_TEST_PER_CLASS,
    PAPER_VAL_PER_CLASS,
    ROOT_NAME,
    WHERE_TO_GET,
    Caltech256Index,
    SkippedFile,
    check_tree,
    index_caltech256,
)

__all__ = [
    "PAPER_IMAGE_SIZE",
    "PAPER_TEST_PER_CLASS",
    "PAPER_VAL_PER_CLASS",
    "ROOT_NAME",
    "WHERE_TO_GET",
    "Caltech256Index",
    "Caltech256Splits",
    "SkippedFile",
    "caltech256_dataset",
    "caltech256_splits",
    "check_tree",
    "index_caltech256",
    "load_caltech256",
    "make_synthetic_caltech256",
]
