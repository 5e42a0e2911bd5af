"""DLPack capsules built by hand with ctypes, describing memory on a device
this machine may not have (a CUDA tensor's, device type 2). The binding
checks device, dtype, shape, strides and overlap from the capsule alone, so
these test every check of the cuda_* functions without a GPU. The addresses
are never dereferenced: a call that passes every check must fail on the
missing driver (or, on a GPU machine, must not be made)."""
import ctypes
import itertools

CPU, CUDA = 1, 2
DTYPES = {"float32": (2, 32), "bfloat16": (4, 16), "float16": (2, 16),
          "float64": (2, 64), "int32": (0, 32)}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int32": 4}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManaged(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# Each fake gets address space of its own unless told where to be.
_next_region = itertools.count(1)
REGION = 1 << 24


class Fakes:
    """Makes capsules and keeps their ctypes memory alive as long as it
    lives."""

    def __init__(self):
        self._keep = []

    def address(self):
        return next(_next_region) * REGION

    def __call__(self, n=16, dtype="float32", *, device_type=CUDA, device_id=0,
                 address=None, stride=None):
        shape = (ctypes.c_int64 * 1)(n)
        managed = _DLManaged()
        managed.dl_tensor.data = self.address() if address is None else address
        managed.dl_tensor.device = _DLDevice(device_type, device_id)
        managed.dl_tensor.ndim = 1
        managed.dl_tensor.dtype = _DLDataType(*DTYPES[dtype], 1)
        managed.dl_tensor.shape = shape
        self._keep += [shape, managed]
        if stride is not None:
            strides = (ctypes.c_int64 * 1)(stride)
            managed.dl_tensor.strides = strides
            self._keep.append(strides)
        return _new_capsule(ctypes.addressof(managed), b"dltensor", None)


def fake_capsule(device_type, keep):
    """One 16-element float32 capsule on device_type (the older helper's
    signature)."""
    fakes = Fakes()
    keep.append(fakes)
    return fakes(16, device_type=device_type)


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def as_cuda_capsule(tensor, device_id=0):
    """torch's own DLPack capsule of a CPU tensor, relabelled as memory of
    CUDA device `device_id`: for the emulated driver, whose "device memory"
    is host memory. torch's deleter still owns the tensor's lifetime."""
    capsule = tensor.__dlpack__()
    managed = ctypes.cast(_capsule_pointer(capsule, b"dltensor"), ctypes.POINTER(_DLManaged))
    managed.contents.dl_tensor.device = _DLDevice(CUDA, device_id)
    return capsule
