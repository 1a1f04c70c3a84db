"""pyembed.analysis against hand-computed values on small constructed tables."""

import math
import subprocess
import sys

import pytest
import torch

import pyembed
from pyembed import analysis

MIB = 2**20


def clusters():
    """Two tight clusters: rows 0-2 near e0, rows 3-5 near e1 (d=4), with known angles."""
    return torch.tensor([[1.0, 0.0, 0, 0], [1.0, 0.1, 0, 0], [1.0, 0.0, 0.2, 0],
                         [0.0, 1.0, 0, 0], [0.1, 1.0, 0, 0], [0.0, 1.0, 0, 0.3]])


def test_cosine_similarity_matrix_is_the_closed_form():
    w = clusters()
    sims = analysis.cosine_similarity_matrix(w)
    assert sims.shape == (6, 6)
    torch.testing.assert_close(sims.diagonal(), torch.ones(6))
    assert sims[0, 1].item() == pytest.approx(1 / math.sqrt(1.01), abs=1e-6)
    assert sims[0, 3].item() == pytest.approx(0.0, abs=1e-6)
    sub = analysis.cosine_similarity_matrix(w, ids=[1, 4])
    assert sub[0, 1].item() == pytest.approx((0.1 + 0.1) / 1.01, abs=1e-6)


def test_most_similar_finds_the_cluster_best_first():
    w = clusters()
    top = analysis.most_similar(w, 0, k=2)
    assert [i for i, _ in top] == [1, 2]  # cos 0.995 > 0.981
    assert top[0][1] == pytest.approx(1 / math.sqrt(1.01), abs=1e-6)
    assert top[1][1] == pytest.approx(1 / math.sqrt(1.04), abs=1e-6)
    assert [i for i, _ in analysis.most_similar(w, 0, k=2, exclude=[1])] == [2, 4]
    by_vector = analysis.most_similar(w, torch.tensor([0.0, 1.0, 0.0, 0.0]), k=1)
    assert by_vector[0][0] in (3,) and by_vector[0][1] == pytest.approx(1.0)


def test_analogy_recovers_a_planted_relation_with_words():
    # king - man + woman = queen: royalty on dim 0, gender on dim 1, plus unrelated rows.
    vocab = {"man": 0, "woman": 1, "king": 2, "queen": 3, "apple": 4, "car": 5}
    w = torch.tensor([[0.0, 1.0, 0.0], [0.0, -1.0, 0.0], [1.0, 1.0, 0.0], [1.0, -1.0, 0.0],
                      [0.0, 0.0, 1.0], [0.3, 0.0, -1.0]])
    top = analysis.analogy(w, "man", "king", "woman", k=1, vocab=vocab)
    assert top[0][0] == "queen"
    # target = unit(king) - unit(man) + unit(woman) = (1/√2, 1/√2 - 2, 0); cosine with queen:
    target = torch.tensor([1 / math.sqrt(2), 1 / math.sqrt(2) - 2, 0.0])
    expected = torch.nn.functional.cosine_similarity(target, w[3], dim=0).item()
    assert top[0][1] == pytest.approx(expected, abs=1e-6)
    assert analysis.most_similar(w, "king", k=1, vocab=vocab)[0][0] in ("queen", "man", "apple", "car", "woman")


def test_bad_input_gives_clear_errors():
    w = clusters()
    with pytest.raises(ValueError, match="k=7"):
        analysis.most_similar(w, 0, k=7)
    with pytest.raises(IndexError, match="id 6"):
        analysis.most_similar(w, 6)
    with pytest.raises(ValueError, match="unknown word 'zebra'"):
        analysis.most_similar(w, "zebra", vocab={"a": 0})
    with pytest.raises(ValueError, match="shape"):
        analysis.most_similar(w, torch.ones(3))
    with pytest.raises(ValueError, match=r"\(V, d\)"):
        analysis.cosine_similarity_matrix(torch.ones(3))
    with pytest.raises(ValueError, match="6 rows but 2 labels"):
        analysis.plot_embeddings_2d(w, ["a", "b"])


def test_memory_footprint_closed_forms():
    m = analysis.memory_footprint(50000, 512, max_seq_len=2048, optimizer=None)
    assert m.table_bytes / MIB == pytest.approx(97.65625)  # 50000 x 512 x 4 B
    assert m.position_bytes == 4 * MIB  # 2048 x 512 x 4 B
    assert m.gradient_bytes == m.table_bytes + m.position_bytes and m.optimizer_bytes == 0
    assert analysis.memory_footprint(50000, 512, max_seq_len=2048, pos_encoding="sinusoidal").position_bytes == 0
    adam = analysis.memory_footprint(50257, 768, dtype=torch.bfloat16)
    assert adam.optimizer_bytes == 2 * adam.table_bytes == 2 * 50257 * 768 * 2
    assert adam.total_bytes == 4 * adam.table_bytes
    sparse = analysis.memory_footprint(50257, 768, sparse=True, touched_rows=4096, optimizer="sparse_adam")
    assert sparse.gradient_bytes == 4096 * (768 * 4 + 8)
    # 50257 * 768 * 4 B = 154389504 B = 147.237 MiB
    assert str(analysis.memory_footprint(50257, 768, optimizer=None)).startswith("50257 x 768 fp32: table 147.24 MiB")


def test_plots_write_pngs(tmp_path):
    import matplotlib.image

    for name, fig in [
        ("pe", analysis.plot_positional_encoding(100, 64, path=tmp_path / "pe.png")),
        ("sim", analysis.plot_position_similarity(200, 64, ref_pos=50, path=tmp_path / "sim.png")),
        ("pca", analysis.plot_embeddings_2d(clusters(), list("abcdef"), groups=list("xxxyyy"),
                                            path=tmp_path / "pca.png")),
    ]:
        image = matplotlib.image.imread(tmp_path / f"{name}.png")
        width, height = fig.get_size_inches() * fig.dpi
        assert image.shape[:2] == (round(height), round(width))


def test_cli_memory_heatmap_and_neighbors(tmp_path):
    def run(*args):
        done = subprocess.run([sys.executable, "-m", "pyembed.analysis", *args], capture_output=True, text=True,
                              check=True)
        assert "RuntimeWarning" not in done.stderr, done.stderr  # (runpy's, when the package imported it first)
        return done.stdout
    # 50257 * 768 * 2 B = 77194752 B = 73.62 MiB
    assert "50257 x 768 bf16: table 73.62 MiB" in run("memory", "--vocab", "50257", "--dim", "768", "--dtype", "bf16")
    run("pe-heatmap", "--len", "100", "--dim", "64", "--out", str(tmp_path / "pe.png"))
    assert (tmp_path / "pe.png").stat().st_size > 10_000
    layer = pyembed.EmbeddingLayer(6, 4, 8)
    with torch.no_grad():
        layer.token_embedding.weight.copy_(clusters())
    torch.save(layer.state_dict(), tmp_path / "model.pt")
    out = run("neighbors", "--checkpoint", str(tmp_path / "model.pt"), "--key", "token_embedding.weight",
              "--id", "0", "-k", "2")
    assert [line.split("\t")[0] for line in out.splitlines()] == ["id", "1", "2"]  # a header, then the rows
    missing = subprocess.run([sys.executable, "-m", "pyembed.analysis", "neighbors", "--checkpoint",
                              str(tmp_path / "absent.pt"), "--id", "0"], capture_output=True, text=True)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr, missing.stderr
    assert "no file" in missing.stderr and "torch.save(model.state_dict()" in missing.stderr, missing.stderr


def test_plots_leave_the_users_matplotlib_state_alone(tmp_path):
    # A library must not switch the user's backend (matplotlib.use) or add pyplot figures.
    import matplotlib
    import matplotlib.pyplot as plt

    before, figures = matplotlib.get_backend(), plt.get_fignums()
    pyembed.analysis.plot_positional_encoding(16, 8, path=tmp_path / "pe.png")
    assert matplotlib.get_backend() == before and plt.get_fignums() == figures
    assert (tmp_path / "pe.png").stat().st_size > 0
