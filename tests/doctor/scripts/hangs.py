"""Never reaches an optimizer step: the doctor's time limit must stop it."""
# doctor-expect: timeout
import time

import torch

x = torch.zeros(1)
while True:
    x += 1
    time.sleep(0.01)
