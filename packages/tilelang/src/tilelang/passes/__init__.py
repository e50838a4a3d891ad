"""IR-to-IR passes; `pipeline.py` lists which run for each target, in order."""
