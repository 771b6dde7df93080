"""torchvision in the zoo: every classification model at a small input, and detection and segmentation models.

Classification: `torchvision.models.list_models(module=torchvision.models)`, each built with `weights=None,
num_classes=10` at 32 px (the few that need more get the least they take), batch 8, SGD at 0.01 as a
loop sets it. Detection: the models' own resize set to 64-96 px, 2 images of 2 boxes, the sum of the model's
losses. Segmentation: 64 px masks of 5 classes, "out" + 0.5 x "aux" (torchvision's recipe).
"""

from __future__ import annotations

from zoo_cases import Case, boxes, detection, images, masks, segmentation, sgd, xy_logits

BATCH = 8
SIZE = 32
# the least input a model takes, where 32 px is too small for it (or its constructor's own size argument)
MIN_SIZE = {"inception_v3": 75, "vit_h_14": 28, "alexnet": 64}
CTOR = {  # extra constructor arguments
    "inception_v3": {"aux_logits": False, "init_weights": False},
    "googlenet": {"aux_logits": False, "init_weights": False},
    "vit_b_16": {"image_size": 32}, "vit_b_32": {"image_size": 32}, "vit_l_16": {"image_size": 32},
    "vit_l_32": {"image_size": 32}, "vit_h_14": {"image_size": 28},
    "maxvit_t": {"input_size": (64, 64)},
}
MIN_SIZE["maxvit_t"] = 64


def _classifier(name: str) -> Case:
    def build():
        import torchvision
        return torchvision.models.get_model(name, weights=None, num_classes=10, **CTOR.get(name, {}))
    return Case(name, "torchvision", build, images(BATCH, MIN_SIZE.get(name, SIZE)), xy_logits, sgd(0.01))


def classification_names() -> list[str]:
    import torchvision
    return sorted(torchvision.models.list_models(module=torchvision.models))


def _detector(name: str, size: int, **kw) -> Case:
    def build():
        import torchvision
        m = torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=5, **kw)
        if name.startswith("ssd"):  # its transform is fixed at 320 px: the zoo's images are `size`
            m.transform.min_size, m.transform.max_size = (size,), size
        return m
    kp = kw.get("num_keypoints", 0)
    return Case(name, "torchvision-detection", build,
                boxes(2, size, with_masks=name.startswith("maskrcnn"), keypoints=kp), detection, sgd(0.005))


def _segmenter(name: str, aux: bool = True) -> Case:
    def build():
        import torchvision
        kw = {"aux_loss": True} if aux else {}
        return torchvision.models.get_model(name, weights=None, weights_backbone=None, num_classes=5, **kw)
    return Case(name, "torchvision-segmentation", build, masks(4, 64), segmentation, sgd(0.01))


def cases() -> list[Case]:
    out = [_classifier(n) for n in classification_names()]
    small = {"min_size": 64, "max_size": 64}
    out += [
        _detector("fasterrcnn_mobilenet_v3_large_320_fpn", 64, **small),
        _detector("fasterrcnn_resnet50_fpn", 64, **small),
        _detector("retinanet_resnet50_fpn", 64, **small),
        _detector("fcos_resnet50_fpn", 64, **small),
        _detector("ssdlite320_mobilenet_v3_large", 96),
        _detector("maskrcnn_resnet50_fpn", 64, **small),
        _detector("keypointrcnn_resnet50_fpn", 64, num_keypoints=3, **small),
        _segmenter("deeplabv3_mobilenet_v3_large"),
        _segmenter("deeplabv3_resnet50"),
        _segmenter("fcn_resnet50"),
        _segmenter("lraspp_mobilenet_v3_large", aux=False),
    ]
    return out
