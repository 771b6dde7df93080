"""timm in the zoo: one small model per family, randomly initialised (`pretrained=False`), 10 classes.

Conv nets at 64 px; the models that fix their input size (ViTs, MLP-Mixers, window attention) are built at
the smallest size they take (`img_size=`), batch 8, AdamW at 1e-3 as timm's train script defaults to.
"""

from __future__ import annotations

from zoo_cases import Case, adamw, images, xy_logits

BATCH = 8
# family -> (model, input px, extra constructor arguments)
MODELS: dict[str, tuple[str, int, dict]] = {
    "resnet": ("resnet10t", 64, {}),
    "resnext": ("resnext26ts", 64, {}),
    "seresnext": ("seresnext26t_32x4d", 64, {}),
    "ecaresnet": ("ecaresnet26t", 64, {}),
    "sknet": ("skresnet18", 64, {}),
    "resnest": ("resnest14d", 64, {}),
    "res2net": ("res2net50_14w_8s", 64, {}),
    "resnetv2": ("resnetv2_50", 64, {}),
    "regnet": ("regnetx_002", 64, {}),
    "regnetz": ("regnetz_005", 64, {}),
    "efficientnet": ("efficientnet_b0", 64, {}),
    "efficientnet_lite": ("efficientnet_lite0", 64, {}),
    "efficientnetv2": ("tf_efficientnetv2_b0", 64, {}),
    "mobilenetv2": ("mobilenetv2_050", 64, {}),
    "mobilenetv3": ("mobilenetv3_small_050", 64, {}),
    "mobilenetv4": ("mobilenetv4_conv_small", 64, {}),
    "mnasnet": ("mnasnet_small", 64, {}),
    "tinynet": ("tinynet_e", 64, {}),
    "lcnet": ("lcnet_050", 64, {}),
    "ghostnet": ("ghostnet_050", 64, {}),
    "repghost": ("repghostnet_050", 64, {}),
    "rexnet": ("rexnet_100", 64, {}),
    "mixnet": ("mixnet_s", 64, {}),
    "fbnet": ("fbnetc_100", 64, {}),
    "densenet": ("densenet121", 64, {}),
    "dla": ("dla46_c", 64, {}),
    "dpn": ("dpn48b", 64, {}),
    "cspnet": ("cspresnet50", 64, {}),
    "darknet": ("darknet17", 64, {}),
    "cs3darknet": ("cs3darknet_focus_s", 64, {}),
    "vgg": ("vgg11", 64, {}),
    "repvgg": ("repvgg_a0", 64, {}),
    "mobileone": ("mobileone_s0", 64, {}),
    "hrnet": ("hrnet_w18_small", 64, {}),
    "selecsls": ("selecsls42b", 64, {}),
    "vovnet": ("ese_vovnet19b_slim", 64, {}),
    "hgnet": ("hgnetv2_b0", 64, {}),
    "nfnet": ("nf_regnet_b0", 64, {}),
    "convnext": ("convnext_atto", 64, {}),
    "convnextv2": ("convnextv2_atto", 64, {}),
    "inception_next": ("inception_next_tiny", 64, {}),
    "efficientformer": ("efficientformerv2_s0", 64, {}),
    "mobilevit": ("mobilevit_xxs", 64, {}),
    "mobilevitv2": ("mobilevitv2_050", 64, {}),
    "levit": ("levit_128s", 64, {"img_size": 64}),
    "pvt_v2": ("pvt_v2_b0", 64, {}),
    "poolformer": ("poolformer_s12", 64, {}),
    "edgenext": ("edgenext_xx_small", 64, {}),
    "fastvit": ("fastvit_t8", 64, {}),
    "tiny_vit": ("tiny_vit_5m_224", 64, {}),
    "xcit": ("xcit_nano_12_p16_224", 64, {"img_size": 64}),
    "cait": ("cait_xxs24_224", 64, {"img_size": 64}),
    "mixer": ("mixer_s32_224", 64, {"img_size": 64}),
    "resmlp": ("resmlp_12_224", 64, {"img_size": 64}),
    "gmlp": ("gmlp_ti16_224", 64, {"img_size": 64}),
    "visformer": ("visformer_tiny", 64, {"img_size": 64}),
    "vit": ("vit_tiny_patch16_224", 64, {"img_size": 64}),
    "deit": ("deit_tiny_patch16_224", 64, {"img_size": 64}),
    "eva": ("eva02_tiny_patch14_224", 56, {"img_size": 56}),
    "pit": ("pit_ti_224", 64, {"img_size": 64}),
    "convit": ("convit_tiny", 64, {"img_size": 64}),
    "repvit": ("repvit_m1", 64, {}),
    "efficientvit_mit": ("efficientvit_b0", 64, {}),
    "efficientvit_msra": ("efficientvit_m0", 64, {"img_size": 64}),
    "fasternet": ("fasternet_t0", 64, {}),
    "starnet": ("starnet_s050", 64, {}),
    "rdnet": ("rdnet_tiny", 64, {}),
    "focalnet": ("focalnet_tiny_srf", 64, {"img_size": 64}),
    "davit": ("davit_tiny", 64, {}),
    "gcvit": ("gcvit_xxtiny", 64, {"img_size": 64}),
    "coatnet": ("coatnet_nano_rw_224", 64, {"img_size": 64}),
    "maxvit": ("maxvit_nano_rw_256", 64, {"img_size": 64}),
    "swin": ("swin_tiny_patch4_window7_224", 56, {"img_size": 56}),
    "byoanet": ("lambda_resnet26t", 64, {"img_size": 64}),  # halonet26t takes no input this small
    "gernet": ("gernet_s", 64, {}),
    "mambaout": ("mambaout_femto", 64, {}),
    "shvit": ("shvit_s1", 64, {}),
    "xception": ("xception41", 64, {}),
}


def _case(family: str, name: str, size: int, kw: dict) -> Case:
    def build():
        import timm
        return timm.create_model(name, pretrained=False, num_classes=10, **kw)
    return Case(f"timm/{name}", "timm", build, images(BATCH, size), xy_logits, adamw(1e-3), note=f"family {family}")


def cases() -> list[Case]:
    return [_case(f, *spec) for f, spec in MODELS.items()]
