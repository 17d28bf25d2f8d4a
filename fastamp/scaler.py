# placeholder while the Scaler is being written; replaced in the next commit
import enum


class OptState(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


class Scaler:
    pass
