"""A research user's data, models and losses: the functions the table of
tests/bad_input/test_bad_input_table.py names (copied into its temp dir); `Items`, their
map-style dataset in plain Python, also serves tests/data/test_data_inputs.py."""

import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn, nnx

N = 32


def _x(n=N, d=4, seed=0):
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


def _y(n=N, bad=None, at=5):
    y = np.arange(n, dtype=np.int32) % 3
    if bad is not None:
        y[at] = bad
    return y


class Items:
    """A map-style dataset in plain Python: item i is make(i)."""

    def __init__(self, make, n=N):
        self.make, self.n = make, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.make(i)


# -- models (model.factory)
class Classifier(nn.Module):
    classes: int = 3

    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(self.classes)(nn.relu(nn.Dense(8)(x)))


class Regressor(nn.Module):
    width: int = 1
    squeeze: bool = False

    @nn.compact
    def __call__(self, x, train=False):
        y = nn.Dense(self.width)(x)  # [B, width]
        return y[:, 0] if self.squeeze else y


class Linear5(nnx.Module):  # written for 5 input features
    def __init__(self, rngs):
        self.linear = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


class ImageNet(nn.Module):  # expects flattened 28x28 images
    @nn.compact
    def __call__(self, x, train=False):
        x = x.reshape((x.shape[0], 28, 28, 1))
        return nn.Dense(3)(nn.Conv(4, (3, 3))(x).mean(axis=(1, 2)))


class WithFeatures(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        h = nn.relu(nn.Dense(8)(x))
        return nn.Dense(3)(h), h


class Forgets(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        self.sow("intermediates", "logits", nn.Dense(3)(x))  # and returns None


def classifier(classes=3):
    return Classifier(classes)


def regressor(width=1, squeeze=False):
    return Regressor(width, squeeze)


def linear5():
    return Linear5


def image_net():
    return ImageNet()


def with_features():
    return WithFeatures()


def forgets():
    return Forgets()


# -- data (data.source): the train data, or {"train": ..., "eval": ...}
def clean():
    return {"inputs": _x(), "targets": _y()}


def labels_minus_one():  # -1 for "unknown", as torch's ignore_index
    return {"inputs": _x(), "targets": _y(bad=-1)}


def eval_label_out_of_range():
    return {"train": clean(), "eval": {"inputs": _x(16, seed=1), "targets": _y(16, 3, at=11)}}


def labels_one_based():
    return {"inputs": _x(), "targets": _y() + 1}


def float_labels():
    return {"inputs": _x(), "targets": _y().astype(np.float32)}


def int_regression_targets():  # counts for a regressor with a [B] output
    return {"inputs": _x(), "targets": np.arange(N, dtype=np.int64) % 7}


def binary_labels():  # 0/1 labels for a model with one logit
    return {"inputs": _x(), "targets": (_x()[:, 0] > 0).astype(np.int32)}


def regression_b():  # [B] targets for a [B, 1] output
    return {"inputs": _x(), "targets": _x()[:, 0]}


def regression_two():  # 2 targets per example for a model with 3 outputs
    return {"inputs": _x(), "targets": _x()[:, :2]}


def one_hot():
    return {"inputs": _x(), "targets": np.eye(3, dtype=np.float32)[_y()]}


def bool_targets():
    return {"inputs": _x(), "targets": _x()[:, 0] > 0}


def missing_column():  # a feature missing everywhere, stored as NaN
    x = _x()
    x[:, 2] = np.nan
    return {"inputs": x, "targets": _y()}


def log_counts():  # log of counts with zeros: -inf in every example
    counts = np.random.default_rng(0).poisson(1.0, size=(N, 6)).astype(np.float32)
    counts[:, 0] = 0
    with np.errstate(divide="ignore"):
        return {"inputs": _x(), "targets": np.log(counts)[:, :1]}


def eval_nan():
    x = _x(16, seed=1)
    x[3, 1] = np.nan
    return {"train": clean(), "eval": {"inputs": x, "targets": _y(16)}}


def some_nan_rows():  # accepted: one bad example per batch is skipped, and logged
    x = _x()
    x[3, 0] = np.nan
    return {"inputs": x, "targets": _y()}


def strings():
    return Items(lambda i: {"inputs": f"sample {i}", "targets": i % 3})


def none_targets():  # a missing label as None
    return Items(lambda i: {"inputs": _x()[i], "targets": None if i == 0 else i % 3})


def ragged():
    return Items(lambda i: {"inputs": np.ones(4 if i != 16 else 5, np.float32),
                            "targets": i % 3})


def too_short():
    return {"inputs": _x(5), "targets": _y(5)}


def empty():
    return {"inputs": _x(0), "targets": _y(0)}


LABELS = {f"img{i}.png": i % 3 for i in range(N) if i != 0}


def getitem_raises():  # a label table that misses one file
    return Items(lambda i: {"inputs": _x()[i], "targets": LABELS[f"img{i}.png"]})


def late_label():  # one bad label far past the first batches
    y = _y(400)
    y[300] = 5
    return {"inputs": _x(400), "targets": y}


def stream_with_len():  # accepted: a stream has no random access beyond its first batch
    import torch

    class Stream(torch.utils.data.IterableDataset):
        def __len__(self):
            return N

        def __iter__(self):
            for i in range(N):
                yield np.full((4,), i, np.float32), i % 3

    return Stream()


def eval_wider():  # eval data with one more feature than train
    return {"train": clean(), "eval": {"inputs": _x(16, d=5), "targets": _y(16)}}


def torch_requires_grad():  # accepted: tensors are detached
    import torch

    class Ds(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return torch.full((4,), float(i), requires_grad=True), torch.tensor(i % 3)

    return Ds()


def factory_raises():
    raise FileNotFoundError("data/train.npz")


# -- losses (loss.fn)
def loss_per_example(outputs, batch):  # forgot the .mean()
    return optax.softmax_cross_entropy_with_integer_labels(outputs, batch["targets"])


def loss_one_arg(outputs):
    return jnp.mean(outputs ** 2)


def loss_wrong_field(outputs, batch):
    return optax.softmax_cross_entropy_with_integer_labels(outputs, batch["label"]).mean()


def loss_with_aux(outputs, batch):
    logits, _ = outputs
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
