"""The Gradio internals the app overrides or calls (docs/DEPENDENCIES.md), checked against the installed Gradio.

The app's behaviour behind each is tested elsewhere (tests/app/test_app_robust.py, test_app_files.py,
test_browser.py); these tests name the moved internal when a new Gradio changes one, so that
`scripts/test-latest.sh` says what broke rather than a search failing somewhere downstream.
"""

import inspect

import gradio as gr
import pytest


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_blocks_preprocess_data_is_the_async_hook_guard_inputs_wraps():
    assert inspect.iscoroutinefunction(gr.Blocks.preprocess_data)
    assert _params(gr.Blocks.preprocess_data) == ["self", "block_fn", "inputs", "state", "explicit_call"]


@pytest.mark.parametrize("component, method", [(gr.Image, "preprocess"), (gr.Radio, "preprocess"),
                                               (gr.Slider, "preprocess"), (gr.Gallery, "postprocess")])
def test_component_hooks_take_one_payload(component, method):
    """query_image, loose and result_gallery replace these on the instance with one-argument functions."""
    assert _params(getattr(component, method))[1:] in (["payload"], ["value"])


def test_upload_folder_helpers_keep_their_meaning(tmp_path):
    from gradio.utils import get_upload_folder, is_in_or_equal

    assert isinstance(get_upload_folder(), str) and get_upload_folder()
    assert is_in_or_equal(str(tmp_path / "a" / "b.png"), str(tmp_path / "a"))
    assert not is_in_or_equal(str(tmp_path / "etc" / "passwd"), str(tmp_path / "a"))
    assert not is_in_or_equal(str(tmp_path / "a" / ".." / "x.png"), str(tmp_path / "a"))


def test_gallery_data_validates_the_wire_items_result_gallery_builds():
    from gradio.components.gallery import GalleryData

    wire = [{"image": {"path": "http://127.0.0.1:1/triclip/image/0?v=v000001", "url": None,
                       "orig_name": None, "mime_type": "image/png", "meta": {"_type": "gradio.FileData"}},
             "caption": "a red apple"}]
    data = GalleryData.model_validate(wire)
    assert data.root[0].caption == "a red apple"
    assert data.root[0].image.path.endswith("/triclip/image/0?v=v000001")


def test_launch_takes_extra_routes_through_app_kwargs():
    assert "app_kwargs" in _params(gr.Blocks.launch)
