"""Getting a model onto the device: hub ids, checkpoint formats and tensor sources, the
tokenizer and chat template. Placement is handed in (shardings), never decided here."""
