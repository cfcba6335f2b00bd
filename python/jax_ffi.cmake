# The JAX FFI handler (python/fusedgrpo/_jax_ffi.cc), built with the Python
# package. Included from the `if(SKBUILD)` block of the top-level
# CMakeLists.txt; installs fusedgrpo/libfusedgrpo_jax_ffi.so (component
# fusedgrpo_python) next to libfusedgrpo.so.0, which it links with an $ORIGIN
# rpath. fusedgrpo/jax.py loads it with ctypes and registers its handlers (the
# one-call loss and the phases of a vocab-sharded call) with
# jax.ffi.register_ffi_target.
#
# FG_JAX_FFI = AUTO (default): build it when jaxlib's FFI headers are found,
#                otherwise build the package without it (a message says so;
#                `import fusedgrpo.jax` then fails and says how to reinstall).
#              ON: the headers (and a C++ compiler) are required.
#              OFF: never build it.
# Where the headers come from, first found wins:
#   1. FG_JAX_FFI_INCLUDE_DIR (a directory holding xla/ffi/api/ffi.h, e.g.
#      `python -c "import jax; print(jax.ffi.include_dir())"`);
#   2. jax.ffi.include_dir() of the build interpreter (the jaxlib wheel ships
#      the headers): a `pip install --no-build-isolation .` sees the
#      environment's jax;
#   3. the same interpreter outside pip's build isolation (`python -E`: pip
#      isolates through PYTHONPATH / PYTHONNOUSERSITE, which -E ignores), i.e.
#      the jax of the environment the package is being installed into, so a
#      plain `pip install .` next to jax builds the handler too.
# The handler only speaks XLA's versioned FFI C API (no jaxlib symbols), so a
# handler built against one jaxlib's headers runs with other jaxlib versions
# that accept that API version.
#
# Its CUDA targets (the one-call loss and the head's log-probs on GPU devices,
# _jax_ffi.cc "device handlers") are always compiled: they need no CUDA header
# and link no CUDA library (the stream is an opaque pointer handed to the C
# library, whose CUDA backend makes the calls; the handler's few copies of host
# numbers go through the driver, libcuda.so.1, opened with dlopen on the first
# GPU call). So a package built on a machine without CUDA serves GPUs too.
# Where cuda.h is found (FG_JAX_FFI_CUDA_INCLUDE_DIR, the CUDA toolkit's
# include directory, /usr/local/cuda/include), the handler's declarations of
# those driver entry points are checked against it at compile time.

set(FG_JAX_FFI AUTO CACHE STRING "Build the JAX FFI handler into the Python package: AUTO, ON or OFF")
set_property(CACHE FG_JAX_FFI PROPERTY STRINGS AUTO ON OFF)
set(FG_JAX_FFI_INCLUDE_DIR "" CACHE PATH
    "Directory of jaxlib's FFI headers (xla/ffi/api/ffi.h); empty: ask jax.ffi.include_dir()")
set(FG_JAX_FFI_CUDA_INCLUDE_DIR "" CACHE PATH
    "Directory of cuda.h, to check the JAX handler's CUDA driver declarations; empty: search")

function(fg_jax_ffi_skip why)
  if(FG_JAX_FFI STREQUAL "ON")
    message(FATAL_ERROR "fusedgrpo: FG_JAX_FFI=ON but the JAX FFI handler cannot be built: ${why}")
  endif()
  message(STATUS "fusedgrpo: building the Python package WITHOUT the JAX FFI handler: ${why}. "
                 "fusedgrpo.jax will refuse to import; to get it, install jax first and then "
                 "`pip install --no-build-isolation .` (see python/README.md)")
endfunction()

set(_fg_jax_inc "")
set(_fg_jax_why "")
if(FG_JAX_FFI STREQUAL "OFF")
  set(_fg_jax_why "FG_JAX_FFI=OFF")
elseif(FG_JAX_FFI_INCLUDE_DIR)
  set(_fg_jax_inc "${FG_JAX_FFI_INCLUDE_DIR}")
  set(_fg_jax_src "FG_JAX_FFI_INCLUDE_DIR")
else()
  find_package(Python COMPONENTS Interpreter)
  if(NOT Python_Interpreter_FOUND)
    set(_fg_jax_why "no Python interpreter found to ask jax.ffi.include_dir()")
  else()
    set(_fg_jax_code "import jax.ffi; print(jax.ffi.include_dir())")
    # 2. the build environment; 3. the target environment outside pip's isolation
    foreach(_fg_flags "" "-E")
      execute_process(COMMAND "${Python_EXECUTABLE}" ${_fg_flags} -c "${_fg_jax_code}"
                      RESULT_VARIABLE _fg_rc OUTPUT_VARIABLE _fg_out ERROR_QUIET
                      OUTPUT_STRIP_TRAILING_WHITESPACE)
      if(_fg_rc EQUAL 0 AND EXISTS "${_fg_out}/xla/ffi/api/ffi.h")
        set(_fg_jax_inc "${_fg_out}")
        if(_fg_flags)
          set(_fg_jax_src "jax.ffi.include_dir() of ${Python_EXECUTABLE} ${_fg_flags}, outside pip's build isolation")
        else()
          set(_fg_jax_src "jax.ffi.include_dir() of ${Python_EXECUTABLE}")
        endif()
        break()
      endif()
    endforeach()
    if(NOT _fg_jax_inc)
      set(_fg_jax_why "jax (jaxlib) is not importable by ${Python_EXECUTABLE}")
    endif()
  endif()
endif()

if(_fg_jax_inc AND NOT EXISTS "${_fg_jax_inc}/xla/ffi/api/ffi.h")
  set(_fg_jax_why "${_fg_jax_inc} has no xla/ffi/api/ffi.h")
  set(_fg_jax_inc "")
endif()
if(_fg_jax_inc)
  include(CheckLanguage)
  check_language(CXX)
  if(NOT CMAKE_CXX_COMPILER)
    set(_fg_jax_why "no C++ compiler found")
    set(_fg_jax_inc "")
  endif()
endif()

if(NOT _fg_jax_inc)
  fg_jax_ffi_skip("${_fg_jax_why}")
else()
  message(STATUS "fusedgrpo: building the JAX FFI handler against ${_fg_jax_inc} (${_fg_jax_src})")
  enable_language(CXX)
  add_library(fusedgrpo_jax_ffi MODULE ${CMAKE_CURRENT_LIST_DIR}/fusedgrpo/_jax_ffi.cc)
  set_target_properties(fusedgrpo_jax_ffi PROPERTIES
    OUTPUT_NAME fusedgrpo_jax_ffi      # libfusedgrpo_jax_ffi.so: not a Python extension module
    CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON CXX_EXTENSIONS OFF
    # libfusedgrpo.so.0 sits next to it in the installed package
    INSTALL_RPATH "$ORIGIN" BUILD_WITH_INSTALL_RPATH OFF)
  # Portable: no -march flags here, whatever FG_NATIVE says.
  target_include_directories(fusedgrpo_jax_ffi SYSTEM PRIVATE "${_fg_jax_inc}")
  target_compile_options(fusedgrpo_jax_ffi PRIVATE -O2 -Wall -Wextra)
  target_link_libraries(fusedgrpo_jax_ffi PRIVATE fusedgrpo ${CMAKE_DL_LIBS})
  # cuda.h only checks the driver declarations of the CUDA targets (nothing is
  # linked); CUDAToolkit_INCLUDE_DIRS is set where the project found CUDA.
  find_path(_fg_jax_cuda_h cuda.h
            HINTS ${FG_JAX_FFI_CUDA_INCLUDE_DIR} ${CUDAToolkit_INCLUDE_DIRS}
                  "$ENV{CUDA_HOME}/include" "$ENV{CUDA_PATH}/include"
            PATHS /usr/local/cuda/include)
  mark_as_advanced(_fg_jax_cuda_h)
  if(_fg_jax_cuda_h)
    message(STATUS "fusedgrpo: the JAX FFI handler's CUDA targets, checked against ${_fg_jax_cuda_h}/cuda.h")
    target_include_directories(fusedgrpo_jax_ffi SYSTEM PRIVATE "${_fg_jax_cuda_h}")
    target_compile_definitions(fusedgrpo_jax_ffi PRIVATE FG_JAX_FFI_CUDA_H)
  else()
    message(STATUS "fusedgrpo: the JAX FFI handler's CUDA targets, built without cuda.h "
                   "(their driver declarations unchecked)")
  endif()
  target_link_options(fusedgrpo_jax_ffi PRIVATE -Wl,--no-undefined)
  install(TARGETS fusedgrpo_jax_ffi LIBRARY DESTINATION fusedgrpo COMPONENT fusedgrpo_python)
endif()
