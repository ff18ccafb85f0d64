"""One corpus-file type: reading, writing back byte for byte, atomic writes, updates."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from fuzz.case import to_dict
from fuzz.corpus import file as corpus_file
from fuzz.corpus.file import CorpusFile, new_finding, read, read_all
from fuzz.corpus.store import entries, save_finding
from fuzz.errors import CaseError
from fuzz.export.finding import read_finding

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted((REPO / "corpus").rglob("*.json"))
FINDING = REPO / "corpus" / "findings" / "65db93299de2-257753d4d7ef2742.json"
SEED = REPO / "corpus" / "seeds" / "triton-full-lbnhc.json"


def test_the_corpus_ships_findings_and_seeds():
    assert len([p for p in SHIPPED if p.parent.name == "findings"]) > 50
    assert len([p for p in SHIPPED if p.parent.name == "seeds"]) > 5


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_file_writes_back_byte_for_byte(path, tmp_path):
    found = read(path)
    assert found.dumps() == path.read_text()
    written = found.write(tmp_path / path.name)
    assert (tmp_path / path.name).read_bytes() == path.read_bytes()
    assert written.path == tmp_path / path.name


def test_a_seed_is_a_case_alone_and_a_finding_wraps_one():
    seed, finding = read(SEED), read(FINDING)
    assert seed.seed and seed.meta == {} and not seed.is_finding
    assert not finding.seed and finding.is_finding
    assert finding.meta["signature"] == json.loads(FINDING.read_text())["signature"]
    assert "case" not in finding.meta


def test_a_hand_written_seed_keeps_its_key_order():
    def canonical(path: Path) -> str:
        return json.dumps(json.loads(path.read_text()), indent=1, sort_keys=True)

    unsorted = next(p for p in SHIPPED if p.parent.name == "seeds" and canonical(p) != p.read_text().rstrip("\n"))
    assert read(unsorted).dumps() == unsorted.read_text()


def test_every_reader_reads_the_same_type():
    assert isinstance(next(entries(FINDING)), CorpusFile)
    assert isinstance(read_finding(FINDING), CorpusFile)
    assert corpus_file.load(FINDING) == read(FINDING).case


def test_read_all_reads_a_folder_sorted(tmp_path):
    for name in ("b.json", "a.json"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        (tmp_path / "sub" / name).write_text(SEED.read_text())
    assert [f.path.name for f in read_all(tmp_path)] == ["a.json", "b.json"]
    assert [f.path.name for f in read_all(tmp_path / "sub" / "b.json")] == ["b.json"]


@pytest.mark.parametrize(("text", "message"), [("{", "not valid JSON"), ("[]", "must be a JSON object"), ('{"case": {}}', "groups")])
def test_a_bad_file_is_a_one_line_case_error_naming_it(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(CaseError, match=message) as error:
        read(path)
    assert str(error.value).startswith(f"{path}: ") and "\n" not in str(error.value)


def test_a_missing_file_is_a_case_error(tmp_path):
    with pytest.raises(CaseError, match="cannot read"):
        read(tmp_path / "nowhere.json")


def test_a_seed_is_not_a_finding():
    with pytest.raises(CaseError, match="not a corpus finding"):
        read_finding(SEED)


def test_update_sets_fields_and_keeps_the_rest(tmp_path):
    copy = tmp_path / FINDING.name
    copy.write_text(FINDING.read_text())
    before = json.loads(copy.read_text())
    read(copy).updated(variants=[{"backend": "X"}], confirmed=False).write()
    after = json.loads(copy.read_text())
    assert after == {**before, "variants": [{"backend": "X"}], "confirmed": False}
    assert copy.read_text() == json.dumps(after, indent=1, sort_keys=True) + "\n"


def test_update_can_move_the_file(tmp_path):
    copy = tmp_path / FINDING.name
    copy.write_text(FINDING.read_text())
    moved = read(copy).updated(ci={"status": "flaky"}).write(tmp_path / "flaky" / copy.name)
    assert json.loads(moved.path.read_text())["ci"] == {"status": "flaky"}
    assert moved.path == tmp_path / "flaky" / copy.name


def test_a_seed_has_no_fields_to_update():
    with pytest.raises(CaseError, match="seed"):
        read(SEED).updated(confirmed=True)


def test_a_new_finding_is_written_as_kvfuzz_always_wrote_it(tmp_path):
    case = read(FINDING).case
    meta = {"signature_id": "abc", "kind": "shape", "target": "0.22.0"}
    path = save_finding(tmp_path, case, meta)
    assert path == tmp_path / f"abc-{case.content_hash()}.json"
    expected = {**meta, "reproduce": f"kvfuzz replay {path} --vllm 0.22.0", "case": to_dict(case)}
    assert path.read_text() == json.dumps(expected, indent=1, sort_keys=True) + "\n"
    assert read(path).dumps() == path.read_text()
    assert new_finding(tmp_path, case, meta).path == path


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    copy = tmp_path / FINDING.name
    copy.write_text(FINDING.read_text())
    before = copy.read_bytes()

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        read(copy).updated(confirmed=False).write()
    with pytest.raises(OSError, match="No space"):
        save_finding(tmp_path / "new", read(copy).case, {"signature_id": "x"})
    assert copy.read_bytes() == before
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [FINDING.name]


def test_a_replaced_case_is_written_from_the_case(tmp_path):
    seed, finding = read(SEED), read(FINDING)
    swapped = dataclasses.replace(finding, case=seed.case)
    assert json.loads(swapped.dumps())["case"] == to_dict(seed.case)
