"""`python -m moesim.hw_profiles.regenerate`: rewrite the datasheet-scaled built-in profiles from
the shipped calibrated one (run after refitting `nvidia-h200`; tests check the files are current)."""

from __future__ import annotations

from moesim.hw_profiles.builtin import regenerate

if __name__ == "__main__":
    for written_path in regenerate():
        print(f"wrote {written_path}")
