"""The conformance runner swaps `keras.Model` for `SafeDistributedModel` in Keras's test sources."""

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "conformance_run", Path(__file__).resolve().parents[1] / "conformance" / "run.py"
)
run = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(run)

SOURCE = '''"""A test module."""
import keras
from keras.src import models
from keras.src.models import Model


class Foo(keras.Model):
    pass


def test_it():
    model = keras.Model(inputs, outputs)
    other = models.Model(inputs, outputs)
    bare = Model.from_config(config)
    assert isinstance(model, keras.Model)
    assert issubclass(Foo, (Model, models.Model))
    self.assertIsInstance(other, Model)
    text = "keras.Model(inputs)"
    return models.Sequential(), keras.models.Model(), keras.src.models.model.Model()
'''


def swapped_lines():
    return run.swap_model_references(SOURCE).splitlines()


def test_constructor_and_base_class_are_swapped():
    lines = swapped_lines()
    assert lines[6] == "class Foo(SafeDistributedModel):"
    assert lines[11] == "    model = SafeDistributedModel(inputs, outputs)"
    assert lines[12] == "    other = SafeDistributedModel(inputs, outputs)"
    assert lines[13] == "    bare = SafeDistributedModel.from_config(config)"
    assert lines[18] == (
        "    return models.Sequential(), SafeDistributedModel(), SafeDistributedModel()"
    )


def test_class_checks_and_strings_stay_stock():
    lines = swapped_lines()
    assert lines[14] == "    assert isinstance(model, keras.Model)"
    assert lines[15] == "    assert issubclass(Foo, (Model, models.Model))"
    assert lines[16] == "    self.assertIsInstance(other, Model)"
    assert lines[17] == '    text = "keras.Model(inputs)"'


def test_import_is_added_on_the_first_import_line_so_line_numbers_match_stock():
    lines = swapped_lines()
    assert len(lines) == len(SOURCE.splitlines())
    assert lines[0] == '"""A test module."""'
    assert lines[1] == "from keras_safe_dist import SafeDistributedModel; import keras"
    assert lines[3] == "from keras.src.models import Model"


def test_local_class_named_model_is_not_an_imported_model():
    source = (
        "from keras.src import models\n\n"
        "def test_it():\n"
        "    class Model(models.Model):\n"
        "        pass\n"
        "    return Model()\n"
    )
    lines = run.swap_model_references(source).splitlines()
    assert lines[0] == "from keras_safe_dist import SafeDistributedModel; from keras.src import models"
    assert lines[3] == "    class Model(SafeDistributedModel):"
    assert lines[5] == "    return Model()"


def test_source_without_model_is_returned_unchanged():
    source = "import keras\n\nmodel = keras.Sequential()\nassert isinstance(model, keras.Model)\n"
    assert run.swap_model_references(source) is source
