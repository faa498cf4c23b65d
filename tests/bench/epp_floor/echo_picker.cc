// A do-nothing ext_proc picker in C++ (grpc++ synchronous server, a thread per stream):
// the floor of `bench_epp.py --floor cpp`.  It behaves as tests/bench/epp_echo.py's
// EchoStream: the request headers are held; at the request body's end it answers them
// with the pick (round robin, header and envoy.lb dynamic metadata, content-length
// restored) and sends the body back unchanged in chunks of at most 62,000 bytes; every
// response message is answered as it comes (bodies sent back unchanged).  What the
// ext_proc exchange costs without Python: Envoy's share of the picker's added time.
//
// usage: echo_picker PORT HOST:PORT[,HOST:PORT...]   (prints one line when serving)
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <atomic>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "envoy/service/ext_proc/v3/external_processor.grpc.pb.h"

namespace ep = envoy::service::ext_proc::v3;

static const char kDestination[] = "x-gateway-destination-endpoint";
static const size_t kBodyChunk = 62000;

class Echo final : public ep::ExternalProcessor::Service {
 public:
  explicit Echo(std::vector<std::string> endpoints) : endpoints_(std::move(endpoints)) {}

  grpc::Status Process(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<ep::ProcessingResponse, ep::ProcessingRequest>* stream) override {
    ep::ProcessingRequest req;
    std::vector<std::string> held;
    size_t size = 0;
    while (stream->Read(&req)) {
      switch (req.request_case()) {
        case ep::ProcessingRequest::kRequestBody: {
          const auto& b = req.request_body();
          size += b.body().size();
          held.push_back(b.body());
          if (b.end_of_stream()) {
            stream->Write(Pick(size));
            for (size_t i = 0; i < held.size(); ++i) Body(stream, true, held[i], i + 1 == held.size());
            held.clear();
          }
          break;
        }
        case ep::ProcessingRequest::kResponseBody:
          Body(stream, false, req.response_body().body(), req.response_body().end_of_stream());
          break;
        case ep::ProcessingRequest::kResponseHeaders:
        case ep::ProcessingRequest::kRequestTrailers:
        case ep::ProcessingRequest::kResponseTrailers:
          stream->Write(Unchanged(req.request_case()));
          break;
        default:  // request headers: answered with the pick at the body's end
          break;
      }
    }
    return grpc::Status::OK;
  }

 private:
  ep::ProcessingResponse Pick(size_t content_length) {
    const std::string& to = endpoints_[next_++ % endpoints_.size()];
    ep::ProcessingResponse r;
    auto* common = r.mutable_request_headers()->mutable_response();
    common->set_clear_route_cache(true);
    auto* dest = common->mutable_header_mutation()->add_set_headers()->mutable_header();
    dest->set_key(kDestination);
    dest->set_raw_value(to);
    auto* length = common->mutable_header_mutation()->add_set_headers()->mutable_header();
    length->set_key("content-length");
    length->set_raw_value(std::to_string(content_length));
    google::protobuf::Struct inner;
    (*inner.mutable_fields())[kDestination].set_string_value(to);
    (*(*r.mutable_dynamic_metadata()->mutable_fields())["envoy.lb"].mutable_struct_value())
        = inner;
    return r;
  }

  // the answer to a headers or trailers message that changes nothing
  static ep::ProcessingResponse Unchanged(ep::ProcessingRequest::RequestCase which) {
    ep::ProcessingResponse r;
    if (which == ep::ProcessingRequest::kResponseHeaders) r.mutable_response_headers();
    if (which == ep::ProcessingRequest::kRequestTrailers) r.mutable_request_trailers();
    if (which == ep::ProcessingRequest::kResponseTrailers) r.mutable_response_trailers();
    return r;
  }

  static void Body(grpc::ServerReaderWriter<ep::ProcessingResponse, ep::ProcessingRequest>* stream,
                   bool request, const std::string& chunk, bool end_of_stream) {
    size_t n = chunk.size();
    size_t start = 0;
    do {
      ep::ProcessingResponse r;
      auto* body = request ? r.mutable_request_body() : r.mutable_response_body();
      auto* streamed = body->mutable_response()->mutable_body_mutation()->mutable_streamed_response();
      streamed->set_body(chunk.substr(start, kBodyChunk));
      streamed->set_end_of_stream(end_of_stream && start + kBodyChunk >= n);
      stream->Write(r);
      start += kBodyChunk;
    } while (start < n);
  }

  std::vector<std::string> endpoints_;
  std::atomic<size_t> next_{0};
};

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s PORT HOST:PORT[,HOST:PORT...]\n", argv[0]);
    return 2;
  }
  std::vector<std::string> endpoints;
  std::stringstream list(argv[2]);
  for (std::string e; std::getline(list, e, ',');) endpoints.push_back(e);
  grpc::EnableDefaultHealthCheckService(true);
  Echo echo(endpoints);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(std::string("127.0.0.1:") + argv[1], grpc::InsecureServerCredentials());
  builder.RegisterService(&echo);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) return 1;
  server->GetHealthCheckService()->SetServingStatus(
      "envoy.service.ext_proc.v3.ExternalProcessor", true);
  std::printf("echo ext_proc on %s\n", argv[1]);
  std::fflush(stdout);
  server->Wait();
  return 0;
}
