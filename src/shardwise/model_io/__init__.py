"""Models in and out of files: a full ``state_dict`` to one file, Hugging Face folders, rebuilding a model from a
``model.json`` without running data-chosen code, and sampling text from a trained model."""
