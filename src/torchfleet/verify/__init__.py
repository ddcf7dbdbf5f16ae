"""`torchfleet verify`: does every strategy train the user's model to serial's weights?

Run before renting a cluster: the user's model (a Hugging Face config shrunk to
a few layers and a small width, same architecture, or their own
``MODULE:FUNCTION``) trains a few steps under each strategy that applies, on 2
to 4 CPU processes (or the GPUs present), and each strategy's weights are
compared with one process's. Float order alone can move a model's weights
(a row-wise split sums its products in another order), so serial is also run
with every linear layer's products summed in two halves: that reordered
serial's distance from serial is the floor below which a difference is
rounding. A strategy is "equal" within max(1e-5, twice that floor), "differs"
above it, or "refused" with the one sentence that refused it.

models.py builds the model and its batches, train.py trains one case (the
test suite's zoo calls it too), report.py prints the table.
"""
