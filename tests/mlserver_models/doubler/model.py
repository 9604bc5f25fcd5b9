"""An MLServer model for the "any v2 server" tests: y = 2 * x (FP32). A file `fault` next to this one
breaks the running instance (read on the next request, then removed): `nan` makes every later answer
NaN until the model is reloaded, as a memory fault would."""

from pathlib import Path

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse

FAULT = Path(__file__).with_name("fault")


class Doubler(MLModel):
    async def load(self) -> bool:
        self.broken = False
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        if FAULT.exists():
            self.broken = FAULT.read_text().strip() == "nan"
            FAULT.unlink()
        x = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32)
        y = np.full_like(x, np.nan) if self.broken else x * 2
        return InferenceResponse(model_name=self.name, outputs=[NumpyCodec.encode_output("y", y)])
