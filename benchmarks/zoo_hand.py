"""The hand-written forms people train, each as its script writes it.

Recurrent LMs in the form of PyTorch's word_language_model example (the hidden state carried in the step_fn's
closure, detached each batch, log_softmax + NLLLoss, SGD at lr 20, clipping 0.25), a Transformer LM, an
nn.Transformer seq2seq model, weight tying, sparse embeddings (SGD; SparseAdam), a float64 model, a module with
Python-side state, a KV-cache-style decoder that keeps tensors on `self` between calls, a GAN trained through a
step_fn, and models whose forward returns a tuple, a dict or a dataclass; and (zoo_hand_forms.py) parametrized
weights, activation checkpointing, a TorchScript submodule, a buffer a forward updates, attention with a padding mask
in dict batches, a WGAN-GP critic and a forward that writes its input; and (zoo_hand_forms3.py) 3D convolutions,
frozen backbones, parameter groups, LoRA, packed sequences, max-norm embeddings, fake quantisation, a custom autograd
Function, an orthogonal parametrization, a forward hook, data-dependent branches, strings and namedtuples in batches,
a model compiled by its script, lazy layers, DataParallel, a MAML inner step, multi-label BCE, frame-wise logits and a
loss with parameters of its own; and (zoo_hand_forms4.py) a graph network with a sparse adjacency in its batches,
L-BFGS, attention weights in the loss, stochastic depth from Python's random, an STFT front end, FGSM adversarial
training and a MoCo-style memory bank; and (zoo_hand_forms5.py) mixup's soft targets, a dataclass batch,
progressive unfreezing and a frozen BatchNorm; and (zoo_hand_forms6.py) torch.nn.utils.prune's masks, nested dict
batches, a model the script put in channels_last, and bf16 autocast inside a forward; and (zoo_hand_forms7.py) noise
from a module's own Generator, batch-hard triplet and CLIP losses, the script's cross-entropy as loss_fn (label
smoothing, class weights), segmentation targets with void pixels of 255, and uint8 images scaled by the model; and
(zoo_hand_forms8.py) a BYOL momentum target network, experts in a ParameterList, the LR set by the step from its
own counter, and an L2 penalty added by the step; and (zoo_hand_forms9.py) bf16 autocast written in the step, a
REINFORCE step sampling from torch.distributions, and a step that calls zero_grad() itself; and
(zoo_hand_forms10.py) CTC speech, NumPy inside a forward, messages summed with index_add_, a spatial transformer,
an LSTMCell in a Python loop, a Fourier neural operator with complex weights, and an EMA updated by the step; and
(zoo_hand_forms11.py) conv nets: accuracy scored through NumPy in the step, a U-Net, a Gram-matrix style loss, a
PixelShuffle super-resolution net, a VQ-VAE (cdist, straight-through) and a roi_align box head; and
(zoo_hand_forms12.py) the loop's code around opt.step() (clip_grad_value_, gradients centralized before the step,
a max-norm constraint after it), batches padded to their own longest sequence, a torch.autograd.Function of the
script's own, and bfloat16 weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import zoo_hand_forms  # parametrizations, checkpointing, TorchScript, a WGAN-GP critic, ...
import zoo_hand_forms3  # 3D convs, frozen backbones, LoRA, packed sequences, QAT, ...
import zoo_hand_forms4  # sparse graph batches, L-BFGS, STFT, adversarial and contrastive steps, ...
import zoo_hand_forms5  # mixup's soft targets, a dataclass batch, progressive unfreezing, a frozen BatchNorm
import zoo_hand_forms6  # torch.nn.utils.prune, nested dict batches, the script's channels_last, autocast in forward
import zoo_hand_forms7  # a module's own Generator, triplet and CLIP losses, the script's CE loss_fn, void 255, uint8
import zoo_hand_forms8  # a BYOL momentum target, a ParameterList, the LR set in the step, an L2 penalty
import zoo_hand_forms9  # autocast written in the step, REINFORCE, zero_grad() in the step
import zoo_hand_forms10  # CTC, NumPy in the forward, index_add_, grid_sample, LSTMCell loop, FNO, EMA in the step
import zoo_hand_forms11  # numpy metric in the step, U-Net, Gram style loss, PixelShuffle, VQ-VAE, roi_align
import zoo_hand_forms12  # clip_grad_value_, code before and after opt.step(), ragged batches, autograd.Function, bf16
from bench_ported import MnistNet  # PyTorch's MNIST example's Net, as the ported bench has it
from zoo_cases import (Case, adam, adamw, ce_logits, chains, images, learnable, lm_pairs, mlp, sgd, successors,
                       teacher, vectors, xxy_logits, xy_logits, xy_own, xy_with)

VOCAB, T, N = 256, 16, 8


class RNNModel(nn.Module):
    """word_language_model's RNNModel: encoder, LSTM/GRU, decoder, optional weight tying, log-probabilities."""

    def __init__(self, kind: str, ntoken=VOCAB, ninp=64, nhid=64, nlayers=2, dropout=0.2, tie=False):
        super().__init__()
        self.kind, self.nhid, self.nlayers = kind, nhid, nlayers
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, kind)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie:
            self.decoder.weight = self.encoder.weight

    def forward(self, x, hidden):
        emb = self.drop(self.encoder(x))
        out, hidden = self.rnn(emb, hidden)
        out = self.decoder(self.drop(out)).view(-1, self.decoder.out_features)
        return F.log_softmax(out, dim=1), hidden

    def init_hidden(self, bsz):
        w = next(self.parameters())
        z = w.new_zeros(self.nlayers, bsz, self.nhid)
        return (z, z.clone()) if self.kind == "LSTM" else z


def _repackage(h):
    return h.detach() if torch.is_tensor(h) else tuple(_repackage(v) for v in h)


def carried_hidden_step():
    """The example's loop as a step_fn: the hidden state lives in the closure, detached each batch."""
    state = {"hidden": None}

    def step_fn(model, batch):
        data, targets = batch
        if state["hidden"] is None:
            state["hidden"] = model.init_hidden(data.size(1))
        output, hidden = model(data, _repackage(state["hidden"]))
        state["hidden"] = hidden
        return F.nll_loss(output, targets)
    return step_fn


@learnable
def seq_first(g: torch.Generator):
    """word_language_model's get_batch: data (bptt, batch), targets flattened."""
    ids = chains(N, T + 1, VOCAB, g).t()
    return ids[:-1], ids[1:].reshape(-1)


class SelfHiddenLSTM(nn.Module):
    """An LSTM LM that keeps its hidden state on `self` between calls (no step_fn), detached each call."""

    def __init__(self):
        super().__init__()
        self.emb, self.rnn, self.head = nn.Embedding(VOCAB, 64), nn.LSTM(64, 64, batch_first=True), nn.Linear(64, VOCAB)
        self.hidden = None

    def forward(self, x):
        h = None if self.hidden is None else tuple(v.detach() for v in self.hidden)
        out, self.hidden = self.rnn(self.emb(x), h)
        return self.head(out)


class TransformerLM(nn.Module):
    """word_language_model's TransformerModel, batch first, causal mask; optional tied embedding."""

    def __init__(self, d=64, layers=2, tie=False, own_loss=None):
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, d), nn.Parameter(torch.zeros(1, 64, d))
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d, VOCAB, bias=not tie)
        if tie:
            self.head.weight = self.emb.weight
        self.own_loss = own_loss  # None: logits; "tuple" | "dict" | "dataclass": the model's own loss in that form

    def logits(self, x):
        t = x.size(1)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        return self.head(self.enc(self.emb(x) * math.sqrt(self.emb.embedding_dim) + self.pos[:, :t], mask=mask,
                                  is_causal=True))

    def forward(self, x, targets=None):
        logits = self.logits(x)
        if self.own_loss is None:
            return logits
        loss = None if targets is None else ce_logits(logits, targets)
        if self.own_loss == "tuple":
            return logits, loss
        if self.own_loss == "dict":
            return {"loss": loss, "logits": logits}
        return LMOutput(loss=loss, logits=logits)


@dataclass
class LMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class Seq2Seq(nn.Module):
    """nn.Transformer between two vocabularies: model(src, tgt_in) -> logits for tgt_out."""

    def __init__(self, d=64):
        super().__init__()
        self.src, self.tgt = nn.Embedding(VOCAB, d), nn.Embedding(VOCAB, d)
        self.tf = nn.Transformer(d, 4, 2, 2, 4 * d, dropout=0.1, batch_first=True)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        return self.head(self.tf(self.src(src), self.tgt(tgt), tgt_mask=mask, tgt_is_causal=True))


@learnable
def seq2seq_batch(g: torch.Generator):
    src = chains(N, T, VOCAB, g)  # the target: each source token's fixed successor, after a start token 0
    tgt = torch.cat([torch.zeros(N, 1, dtype=torch.long), successors(VOCAB)[src]], 1)
    return src, tgt[:, :-1], tgt[:, 1:]


@learnable
def regression(g: torch.Generator):
    """A fixed linear map of the input, plus noise."""
    x = torch.randn(32, 32, generator=g)
    return x, x @ teacher(32, 1, salt=5) / 32 ** 0.5 + 0.1 * torch.randn(32, 1, generator=g)


class TextBag(nn.Module):
    """PyTorch's text-classification tutorial: EmbeddingBag(sparse=True) + Linear, called as model(text, offsets)."""

    def __init__(self, classes=4):
        super().__init__()
        self.embedding, self.fc = nn.EmbeddingBag(VOCAB * 8, 32, sparse=True), nn.Linear(32, classes)

    def forward(self, text, offsets):
        return self.fc(self.embedding(text, offsets))


def text_bag_batch(g: torch.Generator):
    lengths = torch.randint(4, 20, (N,), generator=g)
    text = torch.randint(0, VOCAB * 8, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return torch.randint(0, 4, (N,), generator=g), text, offsets


def text_bag_step():
    def step_fn(model, batch):
        label, text, offsets = batch
        return F.cross_entropy(model(text, offsets), label)
    return step_fn


class MatrixFactorization(nn.Module):
    """A recommender's two sparse embeddings and their dot product (SparseAdam over every parameter)."""

    def __init__(self, users=1000, items=2000, d=32):
        super().__init__()
        self.u, self.i = nn.Embedding(users, d, sparse=True), nn.Embedding(items, d, sparse=True)

    def forward(self, users, items):
        return (self.u(users) * self.i(items)).sum(1)


def ratings_batch(g: torch.Generator):
    return (torch.randint(0, 1000, (64,), generator=g), torch.randint(0, 2000, (64,), generator=g),
            torch.rand(64, generator=g) * 5)


class StepCounter(nn.Module):
    """Python-side state: a step counter and a list of the last outputs' means, which the forward reads."""

    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.steps, self.past = 0, []

    def forward(self, x):
        out = self.net(x)
        self.steps += 1
        if self.past:
            out = out + 0.1 * torch.stack(self.past).mean(0)
        self.past = (self.past + [out.detach().mean(0)])[-4:]
        return out


class CachedDecoder(nn.Module):
    """A KV-cache-style decoder (Transformer-XL memory): the last call's keys and values, detached, kept on
    `self` and attended to by the next call."""

    def __init__(self, d=64):
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(VOCAB, d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff, self.head = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)), nn.Linear(d, VOCAB)
        self.cache_k = self.cache_v = None

    def forward(self, x):
        h = self.emb(x)
        q, k, v = self.qkv(h).chunk(3, -1)
        if self.cache_k is not None and self.cache_k.shape[0] == k.shape[0]:
            k_all, v_all = torch.cat([self.cache_k, k], 1), torch.cat([self.cache_v, v], 1)
        else:
            k_all, v_all = k, v
        past = k_all.size(1) - k.size(1)
        mask = torch.ones(k.size(1), k_all.size(1), dtype=torch.bool).tril(past)
        a = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
        self.cache_k, self.cache_v = k.detach(), v.detach()
        h = h + self.out(a)
        return self.head(h + self.ff(h))


class GAN(nn.Module):
    """A generator and a discriminator in one module; the step_fn steps the discriminator with its own
    optimizer and returns the generator's loss, which `fit` (and the loop) step with the generator's."""

    def __init__(self, z=16, d=64):
        super().__init__()
        self.z = z
        self.G = nn.Sequential(nn.Linear(z, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, d), nn.Tanh())
        self.D = nn.Sequential(nn.Linear(d, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))


def gan_step():
    state = {}

    def step_fn(model, batch):
        real = batch[0]
        opt_d = state.setdefault("opt_d", torch.optim.Adam(model.D.parameters(), lr=2e-4, betas=(0.5, 0.999)))
        z = torch.randn(real.size(0), model.z)
        fake = model.G(z)
        ones, zeros = torch.ones(real.size(0), 1), torch.zeros(real.size(0), 1)
        opt_d.zero_grad()
        d_loss = (F.binary_cross_entropy_with_logits(model.D(real), ones)
                  + F.binary_cross_entropy_with_logits(model.D(fake.detach()), zeros))
        d_loss.backward()
        opt_d.step()
        return F.binary_cross_entropy_with_logits(model.D(fake), ones)
    return step_fn


def gan_probe(model, batch):
    z = torch.randn(batch[0].size(0), model.z)
    return F.binary_cross_entropy_with_logits(model.D(model.G(z)), torch.ones(z.size(0), 1))


class VAE(nn.Module):
    """Returns (reconstruction, mu, logvar); the step_fn writes the ELBO, as PyTorch's VAE example does."""

    def __init__(self, d=64, z=8):
        super().__init__()
        self.enc, self.mu, self.lv = nn.Sequential(nn.Linear(d, 128), nn.ReLU()), nn.Linear(128, z), nn.Linear(128, z)
        self.dec = nn.Sequential(nn.Linear(z, 128), nn.ReLU(), nn.Linear(128, d))

    def forward(self, x):
        h = self.enc(x)
        mu, logvar = self.mu(h), self.lv(h)
        return self.dec(mu + torch.randn_like(mu) * (0.5 * logvar).exp()), mu, logvar


def vae_step():
    def step_fn(model, batch):
        x = batch[0]
        recon, mu, logvar = model(x)
        return F.mse_loss(recon, x, reduction="sum") / x.size(0) - 0.5 * (1 + logvar - mu ** 2 - logvar.exp()).sum(1).mean()
    return step_fn


def small_cnn():
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Dropout(0.2), nn.Linear(32, 10))


def _step_case(name, build, batch, step, opt, **kw):
    return Case(f"hand/{name}", "hand", build, batch, step_fn=step, optimizer=opt, **kw)


def cases() -> list[Case]:
    clip = {"clip_grad_norm": 0.25}
    real = lambda g: (torch.rand(32, 64, generator=g) * 2 - 1,)  # noqa: E731
    return [
        _step_case("lstm_lm_carried", lambda: RNNModel("LSTM"), seq_first, carried_hidden_step, sgd(20),
                   fit_kwargs=clip, note="word_language_model: hidden state in the step_fn's closure"),
        _step_case("gru_lm_carried", lambda: RNNModel("GRU"), seq_first, carried_hidden_step, sgd(20),
                   fit_kwargs=clip, note="word_language_model, GRU"),
        _step_case("lstm_lm_tied", lambda: RNNModel("LSTM", tie=True), seq_first, carried_hidden_step, sgd(20),
                   fit_kwargs=clip, note="word_language_model --tied"),
        Case("hand/lstm_hidden_on_self", "hand", SelfHiddenLSTM, lm_pairs(N, T, VOCAB), xy_logits, adam(1e-3),
             note="hidden state kept on self between calls"),
        Case("hand/transformer_lm", "hand", TransformerLM, lm_pairs(N, T, VOCAB), xy_logits, adam(1e-3),
             note="word_language_model's TransformerModel"),
        Case("hand/transformer_lm_tied", "hand", lambda: TransformerLM(tie=True), lm_pairs(N, T, VOCAB), xy_logits,
             adamw(1e-3), note="tied input and output embedding"),
        Case("hand/nn_transformer_seq2seq", "hand", Seq2Seq, seq2seq_batch, xxy_logits, adam(1e-3),
             note="nn.Transformer, model(src, tgt_in)"),
        _step_case("text_bag_sparse_sgd", TextBag, text_bag_batch, text_bag_step, sgd(5.0),
                   note="EmbeddingBag(sparse=True), (label, text, offsets) batches"),
        Case("hand/matrix_factorization_sparseadam", "hand", MatrixFactorization, ratings_batch, xy_with(nn.MSELoss()),
             lambda m: torch.optim.SparseAdam(m.parameters(), lr=1e-2), fit_kwargs={"loss_fn": nn.MSELoss()},
             note="two sparse embeddings, SparseAdam"),
        Case("hand/mlp_float64", "hand", lambda: mlp().double(), vectors(dtype=torch.float64), xy_logits, sgd(0.05),
             note="model and data in float64"),
        Case("hand/step_counter", "hand", StepCounter, vectors(), xy_logits, sgd(0.05),
             note="a step counter and a list of past outputs on self"),
        Case("hand/kv_cache_decoder", "hand", CachedDecoder, lm_pairs(N, T, VOCAB), xy_logits, adam(1e-3),
             note="keys and values kept on self between calls"),
        _step_case("gan", GAN, real, gan_step, lambda m: torch.optim.Adam(m.G.parameters(), lr=2e-4,
                                                                         betas=(0.5, 0.999)),
                   probe=gan_probe, note="generator and discriminator, D stepped inside the step_fn"),
        _step_case("vae", VAE, lambda g: (torch.randn(32, 64, generator=g),), vae_step, adam(1e-3),
                   note="forward returns (recon, mu, logvar)"),
        Case("hand/returns_tuple", "hand", lambda: TransformerLM(own_loss="tuple"), lm_pairs(N, T, VOCAB), xy_own,
             adamw(1e-3), note="forward(x, targets) -> (logits, loss)"),
        Case("hand/returns_dict", "hand", lambda: TransformerLM(own_loss="dict"), lm_pairs(N, T, VOCAB), xy_own,
             adamw(1e-3), note="forward(x, targets) -> {'loss', 'logits'}"),
        Case("hand/returns_dataclass", "hand", lambda: TransformerLM(own_loss="dataclass"), lm_pairs(N, T, VOCAB),
             xy_own, adamw(1e-3), note="forward(x, targets) -> a dataclass with .loss, .logits"),
        Case("hand/cnn_bn_dropout", "hand", small_cnn, images(16, 32), xy_logits, sgd(0.05, momentum=0.9),
             note="a CIFAR-style CNN with BatchNorm and dropout"),
        Case("hand/mnist_cnn_adadelta", "hand", MnistNet, images(16, 28, channels=1), xy_with(nn.NLLLoss()),
             lambda m: torch.optim.Adadelta(m.parameters(), lr=1.0), fit_kwargs={"loss_fn": nn.NLLLoss()},
             note="PyTorch's MNIST example: log_softmax + NLL, Adadelta"),
        Case("hand/mlp_rmsprop", "hand", mlp, vectors(), xy_logits,
             lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3), note="a small MLP under RMSprop"),
        Case("hand/mlp_regression", "hand", lambda: mlp(classes=1), regression,
             xy_with(nn.MSELoss()), adam(1e-3), fit_kwargs={"loss_fn": nn.MSELoss()}, note="regression, MSE"),
    ] + (zoo_hand_forms.cases() + zoo_hand_forms3.cases() + zoo_hand_forms4.cases() + zoo_hand_forms5.cases()
         + zoo_hand_forms6.cases() + zoo_hand_forms7.cases()
         + zoo_hand_forms8.cases() + zoo_hand_forms9.cases() + zoo_hand_forms10.cases()
         + zoo_hand_forms11.cases() + zoo_hand_forms12.cases())
