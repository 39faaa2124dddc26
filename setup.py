"""Packaging for keras_roll.

TensorFlow is deliberately *not* an install requirement: users who already have
``tensorflow``, ``tensorflow-cpu``, ``tensorflow-macos`` (or a vendor build) keep theirs.
Pick one of the extras to have pip install it::

    pip install -e '.[cpu]'        # tensorflow-cpu where it exists (Linux/Windows x86-64),
                                   # plain tensorflow elsewhere (macOS, Linux aarch64)
    pip install -e '.[gpu]'        # tensorflow[and-cuda] (Linux, NVIDIA GPUs)
    pip install -e '.[tf]'         # plain tensorflow
    pip install -e '.[cpu,test]'   # what `make venv` installs
"""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
LONG_DESCRIPTION = README.read_text(encoding="utf-8") if README.is_file() else ""

TF_MIN = "2.16"  # first release whose default Keras is Keras 3.

# tensorflow-cpu only publishes wheels for Linux and Windows on x86-64; elsewhere the
# regular `tensorflow` wheel is already CPU-only. PEP 508 markers have no `not`, hence
# the explicit complement.
_HAS_TF_CPU_WHEEL = (
    'sys_platform != "darwin" and (platform_machine == "x86_64" or platform_machine == "AMD64")'
)
_NO_TF_CPU_WHEEL = (
    'sys_platform == "darwin" or (platform_machine != "x86_64" and platform_machine != "AMD64")'
)

EXTRAS = {
    "cpu": [
        f"tensorflow-cpu>={TF_MIN}; {_HAS_TF_CPU_WHEEL}",
        f"tensorflow>={TF_MIN}; {_NO_TF_CPU_WHEEL}",
    ],
    "gpu": [f"tensorflow[and-cuda]>={TF_MIN}"],
    "tf": [f"tensorflow>={TF_MIN}"],
    "test": ["pytest", "pytest-xdist", "ruff", "matplotlib", "tensorboard", "scipy>=1.9"],
    "examples": ["matplotlib", "tensorboard", "tensorflow-datasets", "importlib_resources"],
}

setup(
    name="keras_roll",
    version="0.1.0",
    description=(
        "Robust local linearity for Keras 3 / TensorFlow: certify linear regions, "
        "train with the ROLL regularizer, evaluate gradient stability."
    ),
    long_description=LONG_DESCRIPTION,
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["keras_roll", "keras_roll.*"]),
    package_data={
        "keras_roll.data": [
            "japanese_vowels/*.ts",
            "japanese_vowels/README.md",
        ],
    },
    include_package_data=False,  # data files come from package_data only
    zip_safe=False,
    install_requires=["numpy", "absl-py", "tqdm"],
    extras_require=EXTRAS,
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Intended Audience :: Science/Research",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
