"""The pieces of examples/train_gpt.py: model.py, data.py, parallel.py, checkpoint.py."""
