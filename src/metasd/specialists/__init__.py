"""Building task-specialised drafters: token datastores (`metasd index`) and distilled drafters (`metasd distill`)."""
