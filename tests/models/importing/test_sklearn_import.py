"""scikit-learn models in, from the object or (when allowed) a pickle, through the command line too:
the scaler folds into the normalization, a classifier keeps its labels, anything else is refused."""

import joblib
import numpy as np
import pytest
import torch

from fusedserve.models import from_sklearn, load_model
from fusedserve.models.importing import UnsupportedModel
from fusedserve.service.cli import main

pytestmark = pytest.mark.timeout(120)


def served(directory, x):
    with torch.no_grad():
        return load_model(directory, device="cpu")(torch.from_numpy(x)).numpy()


def test_a_pipeline_imports_with_its_scaler_and_labels(pipeline, tmp_path):
    report = from_sklearn(pipeline.model, tmp_path / "iris")
    assert report.labels == 3 and report.widths == [6, 8, 5, 3] and report.passed, report
    assert load_model(tmp_path / "iris", device="cpu").labels == ("setosa", "versicolor", "virginica")
    # float64 weights served in float32: a few float32 roundings of probabilities.
    np.testing.assert_allclose(served(tmp_path / "iris", pipeline.x), pipeline.model.predict_proba(pipeline.x),
                               rtol=1e-4, atol=1e-6)


def test_a_regressor_imports_with_a_linear_output(pipeline, tmp_path):
    from sklearn.neural_network import MLPRegressor

    reg = MLPRegressor(hidden_layer_sizes=(7,), activation="tanh", max_iter=200, random_state=0)
    reg.fit(pipeline.x / 100, pipeline.x[:, :2] / 100)
    report = from_sklearn(reg, tmp_path / "reg")
    assert report.activations == ["tanh", "none"] and report.passed, report
    np.testing.assert_allclose(served(tmp_path / "reg", pipeline.x / 100), reg.predict(pipeline.x / 100),
                               rtol=1e-4, atol=1e-5)


def test_the_command_line_imports_a_pickle_only_when_allowed(pipeline, tmp_path, capsys):
    joblib.dump(pipeline.model, tmp_path / "iris.joblib")
    with pytest.raises(SystemExit) as refused:
        main(["import", str(tmp_path / "iris.joblib"), str(tmp_path / "repo" / "iris")])
    assert refused.value.code == 2 and "is a pickle" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["import", str(tmp_path / "iris.joblib"), str(tmp_path / "repo" / "iris"), "--allow-pickle",
              "--version", "4"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "matches scikit-learn" in out and "3 class labels" in out, out
    assert (tmp_path / "repo" / "iris" / "4" / "labels.json").is_file()


def test_the_command_line_names_flags_that_do_not_apply(pipeline, tmp_path, capsys):
    joblib.dump(pipeline.model, tmp_path / "iris.pkl")
    with pytest.raises(SystemExit) as refused:
        main(["import", str(tmp_path / "iris.pkl"), str(tmp_path / "iris"), "--activation", "relu"])
    assert refused.value.code == 2 and "activations do not apply to a .pkl file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        main(["import", str(tmp_path / "iris.txt"), str(tmp_path / "iris")])
    assert refused.value.code == 2 and "import reads .joblib, .onnx" in capsys.readouterr().err


def test_what_is_not_a_scaled_mlp_is_refused(pipeline, tmp_path):
    from sklearn.decomposition import PCA
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import Pipeline

    pca = Pipeline([("pca", PCA(2)), ("mlp", pipeline.model.named_steps["mlp"])])
    with pytest.raises(UnsupportedModel, match=r"step 'pca' \(PCA\) is not a per-feature scaler"):
        from_sklearn(pca, tmp_path / "m")
    with pytest.raises(UnsupportedModel, match="LogisticRegression is not an MLPClassifier or MLPRegressor"):
        from_sklearn(LogisticRegression(), tmp_path / "m")
    with pytest.raises(UnsupportedModel, match="is not fitted"):
        from_sklearn(MLPClassifier(), tmp_path / "m")
    assert not (tmp_path / "m").exists()
