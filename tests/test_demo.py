"""The README's demo, shortened: it starts its own rank processes (pp=2 x dp=2), trains the tiny
GPT on the shipped corpus, and its losses equal the plain single-process model's."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_demo_matches_plain_model():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--steps", "4",
                          "--timeout", "240"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "starting 4 rank processes for pp=2,dp=2" in text
    assert text.count("tokens/s") == 4                        # a progress line per step
    last = [ln for ln in text.splitlines() if ln.startswith("largest loss difference")][0]
    assert float(last.split(":")[1]) < 1e-5, last


def test_corpus_is_small_and_shipped():
    corpus = ROOT / "examples" / "data" / "corpus.txt"
    assert 1_000 < corpus.stat().st_size < 300_000
