"""SVG rendering: clusters, labels, fused VNodes, cut edges, collapsed blocks; a real browser."""
from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from browser_util import colour_mask, ink, screenshot
from conftest import NET8, ROOT
from vgraph import VGraphError, load
from vgraph.cli.main import main
from vgraph.cost.fleet import load_fleet
from vgraph.report.render import CATEGORY_COLORS, render_svg, to_dot
from vgraph.transform.pipeline import DumpInstrument, run_pipeline

FLEETS = ROOT / "networks" / "fleets"


@pytest.fixture(scope="module")
def placed():
    g = load(NET8)
    run_pipeline(g, "precision{target=cuda-sm75},partition{batch=8,replicas=1},fuse-heads",
                 data={"fleet": load_fleet(FLEETS / "t4x4.yml")})
    return g


def drawn_nodes(svg: str) -> int:
    return svg.count('class="node"')


def test_colocation_clusters_and_labels(net8):
    svg = render_svg(net8)
    assert svg.lstrip().startswith("<?xml") or "<svg" in svg[:500]
    assert drawn_nodes(svg) == len(net8)
    assert svg.count('class="cluster"') == 9
    assert "transformer_block_3" in svg and "[required]" in svg
    assert "attention_head" in svg and "[512, 64] float16" in svg and "98.5k params" in svg
    assert "tied: token_embedding" in svg  # the LM head owns no weight of its own


def test_collapse_draws_repeated_blocks_once(net8):
    svg = render_svg(net8, collapse=True)
    assert "transformer_block_0..7 (x8)" in svg
    assert "block{0..7}_ln1" in svg and "block{0..7}_head5" in svg
    assert drawn_nodes(svg) == 22 + 7  # one block and the embedding group
    assert re.search(r">x7<", svg)  # the block-to-block edge, repeated seven times


def test_placement_fused_nodes_and_cut_edges(placed):
    dot = to_dot(placed, group_by="pnode")
    assert 'subgraph "cluster_t4-1"' in dot and "PNode t4-1" in dot
    cuts = [line for line in dot.splitlines() if "->" in line and "#dc2626" in line]
    assert len(cuts) == len(placed.meta["placement"]["stages"])  # a ring: one cut per stage boundary
    assert all("MiB/step" in line for line in cuts)
    fused = [line for line in dot.splitlines() if "fused from 8" in line]
    assert len(fused) == 8 and all('peripheries="2"' in line for line in fused)
    svg = render_svg(placed, group_by="pnode", collapse=True)
    assert "transformer_block_" in svg and "(x" in svg and "8 MiB/step" in svg
    assert "bottleneck" in svg


def test_placement_from_json_and_errors(net8, tmp_path: Path):
    with pytest.raises(VGraphError, match="needs a placement"):
        render_svg(net8, group_by="pnode")
    with pytest.raises(VGraphError, match="group_by"):
        render_svg(net8, group_by="pnodes")
    assignment = {n.id: ("a" if n.group == "token_embedding" else "b") for n in net8.nodes}
    dot = to_dot(net8, group_by="pnode", placement={"assignment": assignment, "batch": 2})
    assert "PNode a" in dot and "PNode b" in dot and "2 MiB/step" in dot


def test_missing_dot_says_how_to_install(net8, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(VGraphError, match="apt-get install graphviz"):
        render_svg(net8)


def test_cli_render_and_pass_dumps(tmp_path: Path, capsys):
    out = tmp_path / "net.svg"
    args = ["render", str(NET8), "-o", str(out), "--fleet", str(FLEETS / "t4x4.yml"), "--passes", "fuse-heads",
            "--collapse"]
    assert main(args) == 0
    assert "clusters by pnode" in capsys.readouterr().out
    svg = html.unescape(out.read_text())  # Graphviz writes '-' as &#45;
    assert "PNode t4-" in svg and "fused from 8" in svg
    run_pipeline(load(NET8), "dead-nodes", instruments=[DumpInstrument(tmp_path / "dump", draw=render_svg)])
    assert (tmp_path / "dump" / "01_dead-nodes.svg").read_text().count('class="node"') == 183


@pytest.mark.slow
def test_a_real_browser_renders_it(net8, tmp_path: Path):
    svg = tmp_path / "net8.svg"
    svg.write_text(render_svg(net8, collapse=True))
    page = tmp_path / "page.html"
    page.write_text(f'<html><body style="margin:0;background:white"><img src="{svg.as_uri()}" '
                    f'style="max-width:100vw;max-height:100vh"></body></html>')
    pixels = screenshot(page, tmp_path / "shot.png", 800, 1000)
    assert ink(pixels) > 0.01  # the drawing, not a blank page
    assert colour_mask(pixels, CATEGORY_COLORS["layer"], 0.02).sum() > 500  # filled layer boxes
