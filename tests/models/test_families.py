"""The table of families (``models.families``): every row's object describes itself consistently, the folder
recognition asks it (``detect_family``), and a name that is not in it is a ``ValueError`` naming the known ones.
Configs and names only: nothing is built or loaded."""

from __future__ import annotations

import json

import pytest

from models import families
from models.common.loading import ModelLoadError, detect_family, model_name
from models.families import FAMILIES, Family


def _protocol_members() -> set[str]:
    """The attributes and methods :class:`Family` declares."""
    return set(Family.__annotations__) | {n for n, v in vars(Family).items() if callable(v) and not n.startswith("_")}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_row_is_a_family_of_that_name(name):
    family = families.family(name)
    assert family.name == name
    missing = [m for m in _protocol_members() if not hasattr(family, m)]
    assert not missing, f"{name} lacks {missing}"
    assert family.pipelines and family.transformers and family.transformer_subfolders[0] == "transformer"
    assert families.by_default_name(family.default_name) is family
    assert all(families.by_pipeline(p) is family for p in family.pipelines)
    assert all(families.by_transformer(t) is family for t in family.transformers)
    assert all(families.by_upsampler(u) is family for u in family.upsamplers)


def test_no_two_families_claim_a_class_or_a_name():
    rows = families.all_families()
    for attribute in ("pipelines", "transformers", "upsamplers"):
        claimed = [c for f in rows for c in getattr(f, attribute)]
        assert len(claimed) == len(set(claimed)), attribute
    assert len({f.default_name for f in rows}) == len(rows)
    assert model_name(None) == families.default_model_name() == families.family(families.DEFAULT_FAMILY).default_name


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_folder_is_recognised_through_the_table(name, tmp_path):
    family = families.family(name)
    for pipeline in family.pipelines:
        (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
        assert detect_family(tmp_path) == name
    (tmp_path / "model_index.json").unlink()
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({"_class_name": family.transformers[0]}))
    assert detect_family(tmp_path) == name


def test_an_unknown_family_or_class_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model family 'hunyuan'; known: ltx-video, ltx2, wan"):
        families.family("hunyuan")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "HunyuanVideoPipeline"}))
    with pytest.raises(ModelLoadError, match=r"pipeline class 'HunyuanVideoPipeline' .* supported: LTXPipeline, "):
        detect_family(tmp_path)
