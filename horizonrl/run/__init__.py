"""The per-process runtime holder and the run lock."""
