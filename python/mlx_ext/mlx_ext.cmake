# Included by python/CMakeLists.txt: the expertqmm._mlx module (MLX custom primitives).
# EXPERTQMM_MLX_DIR (an mlx package directory: include/, lib/libmlx.so) overrides the one Python imports.
set(EXPERTQMM_MLX_DIR "" CACHE PATH "The mlx package directory to build against (empty: the one Python imports)")
set(mlx_missing 0)
if(NOT EXPERTQMM_MLX_DIR)
  execute_process(COMMAND "${Python_EXECUTABLE}" -c "import mlx, os; print(os.path.abspath(list(mlx.__path__)[0]))"
                  OUTPUT_VARIABLE EXPERTQMM_MLX_DIR OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE mlx_missing
                  ERROR_QUIET)
endif()
set(MLX_LIBRARY "${EXPERTQMM_MLX_DIR}/lib/libmlx.so")
if(mlx_missing OR NOT EXISTS "${MLX_LIBRARY}" OR NOT EXISTS "${EXPERTQMM_MLX_DIR}/include/mlx/primitives.h")
  if(EXPERTQMM_PYTHON_MLX STREQUAL "ON")
    message(FATAL_ERROR "EXPERTQMM_PYTHON_MLX=ON but ${Python_EXECUTABLE} has no mlx with its headers and libmlx.so "
                        "(pip install mlx, then build with --no-build-isolation)")
  endif()
  message(STATUS "expertqmm: no mlx for ${Python_EXECUTABLE}: expertqmm._mlx is not built")
  return()
endif()
# The headers and libmlx.so the wheel ships, used directly: MLXConfig.cmake of a CUDA wheel also
# demands cuDNN's CMake package, which the primitives do not use.
add_library(expertqmm_libmlx SHARED IMPORTED)
set_target_properties(expertqmm_libmlx PROPERTIES IMPORTED_LOCATION "${MLX_LIBRARY}")
# SYSTEM: MLX's headers are not held to our warning flags.
target_include_directories(expertqmm_libmlx SYSTEM INTERFACE "${EXPERTQMM_MLX_DIR}/include")

# MLX's CUDA backend is in libmlx.so when it exports the stream's command encoder; only then (and
# with our CUDA backend) do the primitives get an eval_gpu that runs our kernels.
set(EXPERTQMM_MLX_CUDA OFF)
if(EXPERTQMM_HAVE_CUDA)
  execute_process(COMMAND nm -D --defined-only "${MLX_LIBRARY}" OUTPUT_VARIABLE mlx_symbols ERROR_QUIET)
  string(FIND "${mlx_symbols}" "_ZN3mlx4core2cu19get_command_encoderENS0_6StreamE" encoder_at)
  if(NOT encoder_at EQUAL -1)
    set(EXPERTQMM_MLX_CUDA ON)
  endif()
  unset(mlx_symbols)
endif()
message(STATUS "expertqmm: expertqmm._mlx against ${MLX_LIBRARY} (MLX CUDA backend: ${EXPERTQMM_MLX_CUDA})")

file(GLOB EXPERTQMM_MLX_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/*.cpp)
if(EXPERTQMM_MLX_CUDA)
  list(APPEND EXPERTQMM_MLX_SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda/mlx_stream.cpp)
else()
  list(APPEND EXPERTQMM_MLX_SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda/no_mlx_cuda.cpp)
endif()
# NB_DOMAIN mlx: the nanobind domain of MLX's own module, so mx.array arguments are MLX's type.
nanobind_add_module(_mlx NB_STATIC NB_DOMAIN mlx ${EXPERTQMM_MLX_SOURCES})
target_include_directories(_mlx PRIVATE ${CMAKE_CURRENT_LIST_DIR})
target_link_libraries(_mlx PRIVATE ${EXPERTQMM_PYTHON_LIBRARY} expertqmm_libmlx)
if(EXPERTQMM_MLX_CUDA)
  target_compile_definitions(_mlx PRIVATE EXPERTQMM_MLX_CUDA=1)
  target_include_directories(_mlx SYSTEM PRIVATE ${CUDAToolkit_INCLUDE_DIRS})
  # MLX's CUDA headers include <fmt/format.h>, which the wheel does not ship (cuda/fmt_shim says why
  # a declaration is enough).
  find_path(EXPERTQMM_FMT_INCLUDE fmt/format.h)
  if(NOT EXPERTQMM_FMT_INCLUDE)
    target_include_directories(_mlx SYSTEM PRIVATE ${CMAKE_CURRENT_LIST_DIR}/cuda/fmt_shim)
  endif()
endif()
set_target_properties(_mlx PROPERTIES CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON BUILD_WITH_INSTALL_RPATH ON
                      INSTALL_RPATH "$ORIGIN/../mlx/lib;${EXPERTQMM_MLX_DIR}/lib")
target_compile_options(_mlx PRIVATE -Wall -Wextra)
expertqmm_private_static_archives(_mlx)  # python/CMakeLists.txt says why
install(TARGETS _mlx LIBRARY DESTINATION expertqmm)
add_dependencies(expertqmm_python _mlx)
