"""scikit-learn models to ``graph.Op``s: a fitted ``MLPClassifier`` or ``MLPRegressor``, alone or at the
end of a ``Pipeline`` whose earlier steps are per-feature scalers (folded into the input normalization).
A classifier keeps its classes as labels; a binary one answers both classes' probabilities, as
``predict_proba`` does. Needs the ``sklearn`` extra."""

from __future__ import annotations

import numpy as np
import torch

from fusedserve.models.importing.graph import Op, UnsupportedModel

SOURCE = "X"
SCALERS = ("StandardScaler", "MinMaxScaler", "MaxAbsScaler", "RobustScaler")
_HIDDEN = {"identity": lambda z: z, "logistic": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu}


def _binary(z: torch.Tensor) -> torch.Tensor:
    """A 1-unit logistic output as ``predict_proba`` gives it: [1 - p, p]."""
    p = torch.sigmoid(z)
    return torch.cat([1 - p, p], dim=-1)


def _steps(estimator) -> list[tuple[str, object]]:
    from sklearn.pipeline import Pipeline

    return list(estimator.steps) if isinstance(estimator, Pipeline) else [("", estimator)]


def _scaler_op(name: str, step, previous: str) -> Op:
    where = f"step {name!r} ({type(step).__name__})"
    if type(step).__name__ not in SCALERS:
        raise UnsupportedModel(f"{where} is not a per-feature scaler ({', '.join(SCALERS)}) or the MLP; import "
                               "folds scalers into the input normalization and runs nothing else before the MLP")

    def transform(z: torch.Tensor, step=step) -> torch.Tensor:
        return torch.from_numpy(np.asarray(step.transform(z.numpy()), dtype=np.float64))

    return Op(where, (previous,), f"{name}:out", fn=transform)


def read(estimator) -> tuple[list[Op], str, str, tuple[str, ...]]:
    """The ops of a fitted estimator, its input's and output's names and its class labels."""
    from sklearn.neural_network import MLPClassifier, MLPRegressor

    *scalers, (name, mlp) = _steps(estimator)
    if not isinstance(mlp, (MLPClassifier, MLPRegressor)):
        raise UnsupportedModel(f"{type(mlp).__name__} is not an MLPClassifier or MLPRegressor (alone or last in a "
                               "Pipeline)")
    if not hasattr(mlp, "coefs_"):
        raise UnsupportedModel(f"the {type(mlp).__name__} is not fitted: call fit() first")
    ops, previous = [], SOURCE
    for step_name, step in scalers:
        ops.append(_scaler_op(step_name, step, previous))
        previous = ops[-1].output
    last = len(mlp.coefs_) - 1
    for i, (coef, intercept) in enumerate(zip(mlp.coefs_, mlp.intercepts_, strict=True)):
        where = f"layer {i} of {type(mlp).__name__}"
        ops.append(Op(where, (previous,), f"layer{i}", weight=torch.from_numpy(np.asarray(coef, np.float64).T.copy()),
                      bias=torch.from_numpy(np.asarray(intercept, np.float64).copy())))
        if i < last:
            act = _HIDDEN[mlp.activation]
        elif mlp.out_activation_ == "softmax":
            act = lambda z: torch.softmax(z, dim=-1)  # noqa: E731
        elif mlp.out_activation_ == "logistic":
            act = _binary if coef.shape[1] == 1 and isinstance(mlp, MLPClassifier) else torch.sigmoid
        else:
            act = _HIDDEN[mlp.out_activation_]
        ops.append(Op(f"{mlp.activation if i < last else mlp.out_activation_} of {where}", (f"layer{i}",),
                      f"act{i}", fn=act))
        previous = f"act{i}"
    classes = getattr(mlp, "classes_", None) if isinstance(mlp, MLPClassifier) else None
    labels = () if classes is None or np.ndim(classes) != 1 else tuple(str(c) for c in classes)
    return ops, SOURCE, previous, labels


def answer(estimator):
    """The source's answer to float32 rows: ``predict_proba`` of a classifier, ``predict`` otherwise."""
    from sklearn.neural_network import MLPClassifier

    if isinstance(_steps(estimator)[-1][1], MLPClassifier):
        return estimator.predict_proba
    return lambda x: np.asarray(estimator.predict(x)).reshape(len(x), -1)
