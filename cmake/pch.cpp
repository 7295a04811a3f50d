// The translation unit of the voodoo_pch target (CMakeLists.txt, VOODOO_PCH): empty; CMake makes LibTorch's
// precompiled header with it, which libvoodoo, voodoo and the test programs reuse.
