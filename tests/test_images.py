"""images/: every diagram is drawn by course_utils.images; the schedules are right."""

import re
import struct

from course_utils import build, images


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_every_image_is_drawn_by_the_script(tmp_path):
    drawn = {p.name: p for p in images.draw_all(tmp_path)}
    shipped = {p.name: p for p in images.IMAGES_DIR.glob("*.png")}
    assert set(drawn) == set(shipped), "run `make images` and commit images/"
    for name in drawn:
        # the same code draws the same picture (bytes may differ by font build)
        assert _png_size(drawn[name].read_bytes()) == _png_size(
            shipped[name].read_bytes()), f"{name}: run `make images`"


def test_schedules_respect_dependencies_and_the_bubble_formula():
    for p, m in [(1, 1), (2, 3), (3, 5), (4, 8), (5, 2)]:
        for sched in (images.gpipe_schedule(p, m), images.one_f_one_b_schedule(p, m)):
            when = {(s, k, i): t for s, ops in enumerate(sched) for t, k, i in ops}
            assert len(when) == 2 * p * m
            for s, ops in enumerate(sched):
                slots = [t for t, _, _ in ops]
                assert len(set(slots)) == len(slots)  # one op at a time per stage
                for t, k, i in ops:
                    if k == "F" and s > 0:
                        assert when[(s - 1, "F", i)] < t
                    if k == "B":
                        dep = (s, "F", i) if s == p - 1 else (s + 1, "B", i)
                        assert when[dep] < t
            end = max(when.values()) + 1
            idle = 1 - 2 * p * m / (end * p)
            assert abs(idle - (p - 1) / (m + p - 1)) < 1e-9
        assert images.in_flight(images.gpipe_schedule(p, m)[0]) == m
        assert images.in_flight(images.one_f_one_b_schedule(p, m)[0]) == min(p, m)


def test_start_page_embeds_its_images_and_links_every_chapter():
    start = build.SOURCE_DIR / build.START_SOURCE
    nb = build.generate_start(start)
    assert "../images/" not in nb and "attachment:pipeline_schedules.png" in nb
    text = start.read_text()
    for source in build.chapter_sources():
        assert f"]({source.stem}.ipynb)" in text, f"{source.stem} is not linked"

    for target in re.findall(r"\]\((\d\d_[a-z0-9_]+\.ipynb)\)", text):
        assert (build.NOTEBOOK_DIR / target).exists(), f"{target} does not exist"
