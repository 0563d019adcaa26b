"""PipeDream/DAPPLE profile reader: every shared profile parses; DAG edges, units and errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SHARED_PROFILES as PROFILES

from fxpipe.passes.profiles_io import ProfileFormatError, parse_profile_text, read_profile

# file -> (profile batch size, node lines, edge lines)
EXPECTED = {
    "amoeba-36-pbs-1.txt": (1, 44, 83),
    "bert-24-pbs-6.txt": (6, 29, 52),
    "bert-48-pbs-2.txt": (2, 53, 100),
    "gnmt-16-pbs-64.txt": (64, 96, 122),
    "inception_v3-pbs-128.txt": (128, 326, 362),
    "resnet50-pbs-128.txt": (128, 177, 193),
    "vgg-19-pbs-32.txt": (32, 26, 25),
    "xlnet-36-pbs-1.txt": (1, 43, 151),
}
needs_profiles = pytest.mark.needs_profiles  # conftest: skip locally, fail under CI=true


@needs_profiles
@pytest.mark.parametrize("file_name", sorted(EXPECTED))
def test_every_shared_profile_parses(file_name: str) -> None:
    pbs, num_nodes, num_edges = EXPECTED[file_name]
    graph = read_profile(PROFILES / file_name, profile_batch_size=pbs)
    assert len(graph.nodes) == num_nodes
    assert sum(len(node.inputs) for node in graph.nodes) == num_edges
    assert graph.source.startswith("profile:")
    edge_lines = [line.split() for line in (PROFILES / file_name).read_text().splitlines() if line[:1].isspace()]
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    for src, _, dst in edge_lines:  # every edge kept and pointing forwards
        assert src in graph.by_name()[dst].inputs
        assert position[src] < position[dst]


@needs_profiles
def test_bert_mask_feeds_every_layer_and_units_are_per_sample() -> None:
    graph = read_profile(PROFILES / "bert-48-pbs-2.txt", profile_batch_size=2)
    nodes = graph.by_name()
    assert nodes["node2"].op == "attention_mask"
    assert len(graph.consumers()["node2"]) == 48
    layer = nodes["node5"]  # layer_0: 2.69 ms forward, 4.47 ms backward, 4325376 bytes out at pbs 2
    assert layer.op == "layer_0"
    assert layer.forward_s.per_sample == pytest.approx(2.69e-3 / 2)
    assert layer.backward_s.per_sample == pytest.approx(4.47e-3 / 2)
    assert layer.forward_s.fixed == 0.0
    assert layer.output_bytes.per_sample == layer.saved_bytes.per_sample == 4325376 / 2
    assert layer.param_bytes == 50384896
    assert graph.input_bytes.per_sample == 9216 / 2  # input_ids is the only source


@needs_profiles
def test_unordered_ids_and_multi_output_activations() -> None:
    resnet = read_profile(PROFILES / "resnet50-pbs-128.txt", profile_batch_size=128)
    assert resnet.nodes[0].name == "node1"  # the file starts with node77
    amoeba = read_profile(PROFILES / "amoeba-36-pbs-1.txt", profile_batch_size=1)
    assert amoeba.by_name()["node1"].output_bytes.per_sample == 602112 + 4004
    gnmt = read_profile(PROFILES / "gnmt-16-pbs-64.txt", profile_batch_size=64)
    assert gnmt.by_name()["node5"].op.startswith("EmuBidirLSTM(  (bidir): LSTM(1024, 1024, bidirectional=True)")


GOOD = """\
node3 -- Conv2d(3, 8, kernel_size=(3, 3)) -- forward_compute_time=2.0, backward_compute_time=4.0, activation_size=[100; 28], parameter_size=64.000
node1 -- Input -- forward_compute_time=0.0, backward_compute_time=0.0, activation_size=40, parameter_size=0
node2 -- a -- b -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=80.0, parameter_size=0
\tnode1 -- node2
\tnode2 -- node3
  node1 -- node3
"""


def test_small_text_sorts_topologically_and_keeps_labels() -> None:
    graph = parse_profile_text(GOOD, profile_batch_size=4)
    assert [node.name for node in graph.nodes] == ["node1", "node2", "node3"]
    conv = graph.nodes[2]
    assert conv.inputs == ("node2", "node1")
    assert conv.op == "Conv2d(3, 8, kernel_size=(3, 3))"
    assert conv.output_bytes.per_sample == 128 / 4
    assert conv.forward_s.per_sample == pytest.approx(0.5e-3)
    assert graph.nodes[1].op == "a -- b"


@pytest.mark.parametrize(
    ("text", "line_number", "words"),
    [
        (GOOD + "node4 -- broken line\n", 7, "neither a node line"),
        (GOOD + "\tnode3 -- node9\n", 7, "node9"),
        (GOOD + "\tnode3 -- node2\n", 7, "cycle"),
        (GOOD.replace("activation_size=80.0", "activation_size=lots"), 3, "not a number"),
        (GOOD + GOOD.splitlines()[1] + "\n", 7, "defined twice"),
    ],
)
def test_malformed_text_names_the_line(text: str, line_number: int, words: str) -> None:
    with pytest.raises(ProfileFormatError, match=words) as info:
        parse_profile_text(text, profile_batch_size=1, source="bad.txt")
    assert f"bad.txt:{line_number}:" in str(info.value)
    assert text.splitlines()[line_number - 1].strip() in str(info.value)


def test_malformed_file_reports_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.txt"
    path.write_text(GOOD.replace("parameter_size=0\n", "parameter_size=\n", 1))
    with pytest.raises(ProfileFormatError, match=r"broken.txt:2:"):
        read_profile(path, profile_batch_size=1)
    with pytest.raises(ValueError, match="profile_batch_size"):
        read_profile(path, profile_batch_size=0)
