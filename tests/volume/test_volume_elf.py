"""ELF facts through pyelftools: class, NEEDED, the ABI note; clear errors."""

from __future__ import annotations

import pytest

from actors.volume import ElfError, ElfInfo, read_elf

V = "550.54.15"


def lib(driver, directory, filename):
    return str(driver.dirs[directory] / filename)


def test_class_needed_and_abi_note_of_64_bit_libraries(fake_driver):
    egl = read_elf(lib(fake_driver, "lib64", "libEGL.so.1.1.0"))
    assert egl.elf_class == 64 and egl.machine == "EM_X86_64"
    assert egl.needed == ("libGLdispatch.so.0",)
    assert egl.abi_version is None
    gles = read_elf(lib(fake_driver, "lib64", "libGLESv2.so.2.1.0"))
    assert gles.needed == (f"libnvidia-glcore.so.{V}",)
    assert read_elf(lib(fake_driver, "lib64", "libGL.so.1.7.0")).needed == ()
    assert read_elf(lib(fake_driver, "lib64", f"libnvidia-tls.so.{V}")).abi_version == "2.3.99"
    assert read_elf(lib(fake_driver, "lib64", "libnvidia-tls.so.2.0")).abi_version == "2.3.0"
    assert read_elf(lib(fake_driver, "lib64", "libnvidia-tls.so.1.0")).abi_version is None


def test_32_bit_class(fake_driver):
    if not fake_driver.has_32bit:
        pytest.skip(f"no 32-bit libraries: {fake_driver.no_32bit_reason}")
    info = read_elf(lib(fake_driver, "lib32", "libcuda.so.1"))
    assert info.elf_class == 32 and info.machine == "EM_386"


def test_a_real_system_library():
    info = read_elf("/bin/sh")
    assert info.elf_class in (32, 64)
    assert any(name.startswith("libc.so") for name in info.needed)
    assert isinstance(info, ElfInfo)


def test_a_text_file_is_not_elf(tmp_path):
    path = tmp_path / "libcuda.so.1"
    path.write_text("INPUT ( libcuda.so.550 )\n")
    with pytest.raises(ElfError) as info:
        read_elf(str(path))
    assert str(info.value) == (
        f"Failed to load ELF file '{path}': not an ELF file"
        " (starts with b'INPU', expected b'\\x7fELF')")


def test_a_truncated_elf_file(fake_driver, tmp_path):
    source = fake_driver.dirs["lib64"] / "libEGL.so.1.1.0"
    for size in (4, 20, 64, 300, 2000):
        path = tmp_path / f"cut{size}.so"
        path.write_bytes(source.read_bytes()[:size])
        with pytest.raises(ElfError, match=rf"^Failed to load ELF file '{path}': corrupt or truncated \("):
            read_elf(str(path))


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ElfError, match=f"Failed to load ELF file '{tmp_path}/nope': No such file or directory"):
        read_elf(str(tmp_path / "nope"))
    with pytest.raises(ElfError, match=f"Failed to load ELF file '{tmp_path}': Is a directory"):
        read_elf(str(tmp_path))
